"""Speech side: corpus, units, vocoder, tokenizer, the shipped TextToSemantic and the pipeline."""

from __future__ import annotations


from .pipeline import MODES, Mode, SpeechModel, Synthesis, load_speech_model, synthesize


def load_default() -> SpeechModel:
    """The trained model shipped in the package (model in eval mode, tokenizer, unit extractor, vocoder)."""
    return load_speech_model(None)


__all__ = ["MODES", "Mode", "SpeechModel", "Synthesis", "load_default", "load_speech_model", "synthesize"]
