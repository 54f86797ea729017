"""Checkpoint save/load (safetensors + JSON, no pickle) and the shipped default."""

import json

import pytest
import torch

from tts_specdec.speech.checkpoint import FILES, Checkpoint, load_checkpoint, save_checkpoint
from tts_specdec.speech.model import ModelConfig, build_model
from tts_specdec.speech.pipeline import ASSETS
from tts_specdec.speech.tokenizer import CharTokenizer

TINY = ModelConfig(n_units=16, num_text_token_ids=CharTokenizer().num_text_token_ids, dim=32,
                   source_depth=1, target_depth=4, target_early_exit_layer=1, heads=2, dim_head=16)


def tiny_checkpoint(seed: int = 0) -> Checkpoint:
    torch.manual_seed(seed)
    tokenizer = CharTokenizer()
    model = build_model(TINY, tokenizer_encode=tokenizer)
    return Checkpoint(model, TINY, tokenizer, torch.randn(16, 80), meta={"note": "test"})


def test_config_ids_keep_pad_apart_from_eos():
    model = build_model(TINY)
    assert model.pad_id["speech"] == TINY.semantic_pad_id == 16
    assert model.eos_id["speech"] == TINY.semantic_eos_id == 17
    assert model.semantic_token_emb.num_embeddings == 18  # pad and EOS are valid embedding rows


def test_save_load_round_trip_is_exact(tmp_path):
    ckpt = tiny_checkpoint()
    save_checkpoint(tmp_path, ckpt)
    loaded = load_checkpoint(tmp_path)
    original, restored = ckpt.model.state_dict(), loaded.model.state_dict()
    assert original.keys() == restored.keys()
    assert all(torch.equal(original[k], restored[k]) for k in original)
    # tied weights stay tied after loading
    assert loaded.model.to_logits["speech"].weight is loaded.model.token_emb["speech"].weight
    assert loaded.config == TINY and loaded.meta == {"note": "test"} and not loaded.model.training
    assert torch.equal(loaded.centroids, ckpt.centroids)
    text = loaded.tokenizer(["is the cat red?"])
    units = torch.randint(0, 16, (1, 9))
    ckpt.model.eval()
    assert torch.equal(ckpt.model(text, units, source_type="text", target_type="speech", cond_drop_prob=0.0),
                       loaded.model(text, units, source_type="text", target_type="speech", cond_drop_prob=0.0))


def test_missing_and_mismatched_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="directory"):
        load_checkpoint(tmp_path / "nowhere")
    save_checkpoint(tmp_path, tiny_checkpoint())
    config = json.loads((tmp_path / "config.json").read_text())
    config["model"]["target_depth"] = 5
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not match"):
        load_checkpoint(tmp_path)
    config["model"]["bogus"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="bogus"):
        load_checkpoint(tmp_path)


def test_bad_config():
    with pytest.raises(ValueError, match="target_early_exit_layer"):
        ModelConfig(target_depth=4, target_early_exit_layer=5)


@pytest.mark.skipif(not (ASSETS / "model.safetensors").exists(), reason="no shipped checkpoint yet")
def test_shipped_default_loads_offline_and_fits_budget():
    from tts_specdec.speech import load_default

    assert sum((ASSETS / name).stat().st_size for name in FILES) <= 25 * 2**20
    speech = load_default()
    config = speech.config
    assert not speech.model.training
    assert config.target_early_exit_layer <= config.target_depth // 4
    assert speech.units.codebook_size == speech.vocoder.codebook_size == config.n_units


def _edit_config(path, section, key, value):
    config = json.loads((path / "config.json").read_text())
    if value is _DELETE:
        del config[section][key]
    else:
        config[section][key] = value
    (path / "config.json").write_text(json.dumps(config))


_DELETE = object()


@pytest.mark.parametrize("section, key, value, message", [
    ("model", "dim", _DELETE, "config.json: model: missing keys ['dim']"),
    ("model", "dim", "32", "config.json: model.dim: must be a finite int, got '32'"),
    ("model", "heads", True, "config.json: model.heads: must be a finite int"),
    ("model", "cond_drop_prob", None, "config.json: model.cond_drop_prob: must be a finite float"),
    ("mel", "sample_rate", 22050, "config.json: mel.sample_rate: must be 16000"),
    ("mel", "n_mels", 64, "units.safetensors: centroids must be finite, of shape"),
    ("mel", "f_max", 9000.0, "config.json: mel.f_min: needs 0 <= f_min < f_max <= sample_rate / 2"),
    ("model", "num_text_token_ids", 40, "tokenizer.json: 33 characters + padding"),
])
def test_config_errors_name_file_and_key(tmp_path, section, key, value, message):
    save_checkpoint(tmp_path, tiny_checkpoint())
    _edit_config(tmp_path, section, key, value)
    with pytest.raises(ValueError) as error:
        load_checkpoint(tmp_path)
    assert message in str(error.value) and str(tmp_path) in str(error.value)


def test_weights_are_checked_against_the_config_and_for_nan(tmp_path):
    from safetensors.torch import load_file, save_file

    save_checkpoint(tmp_path, tiny_checkpoint())
    state = load_file(str(tmp_path / "model.safetensors"))
    name = next(k for k, v in state.items() if v.dim() == 2)
    good = state[name]
    state[name] = torch.zeros(good.shape[0] + 1, good.shape[1])
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"model.safetensors: {name} has shape"):
        load_checkpoint(tmp_path)
    state[name] = good.clone()
    state[name][0, 0] = float("nan")
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"model.safetensors: {name} holds NaN"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        load_checkpoint(tmp_path)
