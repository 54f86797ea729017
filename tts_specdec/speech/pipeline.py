"""Text -> units -> waveform with any decoding mode of `SpeculativeDecoder`.

Data flows one way: recipes -> this pipeline -> SpeculativeDecoder -> the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from spear_tts_pytorch import TextToSemantic

from ..inputs import check_cond_scale, default_draft_width
from .checkpoint import Checkpoint, load_checkpoint
from .features import MelConfig
from .longtext import MAX_PIECE_CHARS, join_audio, split_text
from .model import ModelConfig
from .tokenizer import CharTokenizer
from .units import MelKMeans
from .vocoder import CentroidVocoder

ASSETS = Path(__file__).resolve().parents[1] / "assets"
# classifier-free guidance for the recipes: the shipped model was trained with condition dropout
DEFAULT_COND_SCALE = 1.0


@dataclass
class SpeechModel:
    """Everything needed to speak: the TextToSemantic (eval mode), its tokenizer, units and vocoder."""
    model: TextToSemantic
    tokenizer: CharTokenizer
    units: MelKMeans
    vocoder: CentroidVocoder
    config: ModelConfig
    mel_config: MelConfig = MelConfig()
    meta: dict = field(default_factory=dict)

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> "SpeechModel":
        return cls(model=ckpt.model.eval(), tokenizer=ckpt.tokenizer,
                   units=MelKMeans(ckpt.centroids, ckpt.mel_config),
                   vocoder=CentroidVocoder(ckpt.centroids, ckpt.mel_config),
                   config=ckpt.config, mel_config=ckpt.mel_config, meta=ckpt.meta)


def load_speech_model(directory: str | Path | None = None) -> SpeechModel:
    """Load a checkpoint directory (default: the one shipped in the package), offline, no pickle."""
    return SpeechModel.from_checkpoint(load_checkpoint(ASSETS if directory is None else directory))


@dataclass(frozen=True)
class Mode:
    """One decoding mode of the demo: which SpeculativeDecoder method and its arguments."""
    name: str
    method: str  # "sample" or "beam_search"
    gamma: int = 0
    beam_size: int = 4
    temperature: float = 0.0
    draft_width: int | None = None  # speculative beam search: draft beams per level

    def describe(self) -> str:
        if self.method == "sample":
            kind = "greedy decoding" if self.temperature == 0 else f"sampling at temperature {self.temperature:g}"
            return kind if not self.gamma else f"{kind}, speculative with the early-exit head as draft (gamma {self.gamma})"
        beams = f"beam search ({self.beam_size} beams"
        if not self.gamma:
            return beams + ")"
        return f"speculative {beams}, gamma {self.gamma}, draft width {self.draft_width or default_draft_width(self.beam_size)})"


MODES: dict[str, Mode] = {
    "plain": Mode("plain", "sample"),
    "spec": Mode("spec", "sample", gamma=4),
    "beam": Mode("beam", "beam_search"),
    # gamma 1, W 8: speculative beam search for comparison; it is slower than beam search wherever
    # measured (docs/performance.md)
    "spec-beam": Mode("spec-beam", "beam_search", gamma=1, draft_width=8),
}


@dataclass
class Synthesis:
    texts: list[str]
    units: list[torch.Tensor]   # per text, (frames,): its pieces' units end to end
    wavs: list[torch.Tensor]    # per text, (samples,): its pieces' audio joined with short pauses
    stats: object               # tts_specdec.DecodeStats of the decoding call
    decode_seconds: float
    vocode_seconds: float
    pieces: list[int] = field(default_factory=list)  # per text, sentence pieces decoded (longtext.split_text)

    @property
    def audio_seconds(self) -> float:
        return sum(w.numel() for w in self.wavs) / 16_000


def default_max_length(source: torch.Tensor) -> int:
    """A cap on units per row: espeak at our rate speaks ~2.5 units per character, so 6x + 40 is
    generous, yet stops a model that never emits EOS long before the decoder's 2048."""
    return int(6 * source.shape[1] + 40)


def decode_units(speech: SpeechModel, texts: list[str], mode: Mode, *, seed: int = 0,
                 max_length: Optional[int] = None, cond_scale: float = 1.0):
    """Run one decoding mode on a batch of texts; returns the decoder's result (tokens, stats)."""
    from tts_specdec import SpeculativeDecoder  # the package root imports speech lazily

    if not isinstance(texts, list) or not texts:
        raise TypeError("texts must be a non-empty list of str")
    source = speech.tokenizer(texts)  # validates: empty text / unknown characters -> ValueError
    max_length = default_max_length(source) if max_length is None else max_length
    decoder = SpeculativeDecoder(speech.model)
    if mode.method == "sample":
        generator = torch.Generator(device=speech.model.device).manual_seed(seed)
        return decoder.sample(source, temperature=mode.temperature, gamma=mode.gamma,
                              max_length=max_length, cond_scale=cond_scale, generator=generator)
    if mode.method == "beam_search":
        return decoder.beam_search(source, beam_size=mode.beam_size, gamma=mode.gamma, draft_width=mode.draft_width,
                                   max_length=max_length, cond_scale=cond_scale)
    raise ValueError(f"mode.method must be 'sample' or 'beam_search', got {mode.method!r}")


def units_only(speech: SpeechModel, tokens: torch.Tensor) -> torch.Tensor:
    """Drop ids that are not k-means units (the reserved padding id, if a sampler ever emits it)."""
    return tokens[tokens < speech.config.n_units]


def synthesize(speech: SpeechModel, texts: list[str], mode: Mode | str = "spec-beam", *,
               seed: int = 0, max_length: Optional[int] = None, cond_scale: float = 1.0,
               max_chars: int = MAX_PIECE_CHARS) -> Synthesis:
    """Texts -> units (chosen decoding mode) -> waveforms (centroid Griffin-Lim vocoder).

    Each text is cut into sentences (and pieces of at most `max_chars` characters where a sentence is
    longer, `longtext.split_text`); every piece of every text is one row of a single decoding call,
    and a text's audio is its pieces' audio joined with short pauses. max_length caps each piece."""
    import time

    if isinstance(mode, str):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
        mode = MODES[mode]
    if not isinstance(texts, list) or not texts:
        raise TypeError("texts must be a non-empty list of str")
    check_cond_scale("cond_scale", cond_scale)
    for text in texts:
        speech.tokenizer.encode_one(text)  # the whole text's error (empty, unknown characters), not a piece's
    pieces = [split_text(text, max_chars) for text in texts]
    out = decode_units(speech, [p for text in pieces for p in text], mode, seed=seed, max_length=max_length,
                       cond_scale=cond_scale)
    units = [units_only(speech, t.cpu()) for t in out.tokens]
    start = time.perf_counter()
    # an utterance needs 2 frames to vocode; a model that stops at once yields a short silence
    wavs = [speech.vocoder(u) if u.numel() >= 2 else torch.zeros(speech.mel_config.hop_length) for u in units]
    text_units, text_wavs, at = [], [], 0
    for n in map(len, pieces):
        text_units.append(torch.cat(units[at:at + n]))
        text_wavs.append(join_audio(wavs[at:at + n], speech.mel_config.sample_rate))
        at += n
    return Synthesis(texts, text_units, text_wavs, out.stats, out.stats.wall_time, time.perf_counter() - start,
                     [len(p) for p in pieces])
