"""SourceEncoder: the source transformer on prepared weights equals spear-tts's module."""

import pytest
import torch

from tts_specdec._upstream import _spear
from tts_specdec.encoder import SourceEncoder

from conftest import make_model, make_source

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}  # relative to the states' magnitude
STD = {torch.float32: 0.3, torch.float64: 0.5}  # see test_decoder: float32 is checked where upstream's rounding is small


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def embedded(model, source):
    return model.token_emb["text"](source), source != 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lengths", [[8, 5, 1], [8, 8, 8]], ids=["padded", "full"])
def test_equals_upstream_source_transformer(dtype, lengths, layout):
    model = make_model(0, heads=4, source_depth=3, dtype=dtype, std=STD[dtype])
    x, mask = embedded(model, make_source(3, 8, lengths=lengths))
    with torch.no_grad():
        ref = model.source_transformer(x, mask=mask)
        ours = SourceEncoder(model.source_transformer)(x, mask)
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    assert rel_err(ours, ref) < TOL[dtype]


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_kv_heads(kv_heads, one_thread):
    """Query head i reads kv head i % kv_heads, as upstream's repeat (spear-tts's own source
    transformer has no kv_heads argument; a Transformer built with them must still come out right)."""
    torch.manual_seed(0)
    tf = _spear.Transformer(dim=32, depth=2, dim_head=16, heads=4, kv_heads=kv_heads).double().eval()
    with torch.no_grad():
        for p in tf.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.5)
        x = torch.randn(2, 6, 32, dtype=torch.float64)
        mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
        assert rel_err(SourceEncoder(tf)(x, mask), tf(x, mask=mask)) < TOL[torch.float64]


def test_longer_source_grows_rotary_tables(one_thread):
    model = make_model(0, dtype=torch.float64)
    enc = SourceEncoder(model.source_transformer)
    with torch.no_grad():
        for n in (5, 100):  # the tables start at 64 positions
            x, mask = embedded(model, make_source(1, n))
            assert rel_err(enc(x, mask), model.source_transformer(x, mask=mask)) < TOL[torch.float64]


def test_decoder_rebuilds_encoder_after_weight_change(one_thread):
    """The encoder's prepared weights follow the model like the decoder's (Decoder.begin)."""
    from tts_specdec.decoder import Decoder

    model = make_model(0, dtype=torch.float64)
    dec = Decoder(model)
    source = make_source(2, 6, lengths=[6, 3])
    with torch.no_grad():
        dec.begin()
        before = dec.encode(source).keys.clone()
        model.source_transformer.layers[0][0].to_out.weight.data.mul_(2.0)  # bypasses the version counter
        dec.begin()
        after = dec.encode(source).keys
        ref = Decoder(model)
        ref.begin()
        assert not torch.allclose(before, after)
        assert rel_err(after, ref.encode(source).keys) < TOL[torch.float64]
