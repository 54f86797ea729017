"""Text -> units -> waveform through SpeculativeDecoder, on a tiny untrained model."""

import pytest
import torch

from tts_specdec.speech.pipeline import MODES, SpeechModel, synthesize
from test_speech_checkpoint import tiny_checkpoint


@pytest.fixture(scope="module")
def speech() -> SpeechModel:
    return SpeechModel.from_checkpoint(tiny_checkpoint(seed=1))


@pytest.mark.parametrize("mode", ["plain", "spec", "beam"])
def test_synthesize_shapes(speech, mode):
    result = synthesize(speech, ["Is the cat red?", "Hi!"], mode, max_length=12)
    assert len(result.wavs) == len(result.units) == 2
    for units, wav in zip(result.units, result.wavs):
        assert units.numel() <= 12 and bool((units < speech.config.n_units).all())
        assert wav.dim() == 1 and wav.numel() == max(1, units.numel() - 1) * 320
    assert result.stats.generated_tokens >= sum(u.numel() for u in result.units)


def test_greedy_speculative_equals_plain(speech):
    plain = synthesize(speech, ["Open the door!"], "plain", max_length=20)
    spec = synthesize(speech, ["Open the door!"], "spec", max_length=20)
    assert torch.equal(plain.units[0], spec.units[0])


def test_bad_input(speech):
    with pytest.raises(ValueError, match="mode"):
        synthesize(speech, ["hello"], "fastest")
    with pytest.raises(ValueError, match="text"):
        synthesize(speech, [""], "plain")
    with pytest.raises(ValueError, match="outside the tokenizer vocabulary"):
        synthesize(speech, ["price: 5 €"], "plain")
    with pytest.raises(TypeError, match="texts"):
        synthesize(speech, "hello", "plain")
    for scale in (1e38, float("nan"), 0.5):
        with pytest.raises(ValueError, match=r"cond_scale must be (finite|in \[1, 100\])"):
            synthesize(speech, ["hello"], "plain", cond_scale=scale)
    assert set(MODES) == {"plain", "spec", "beam", "spec-beam"}
