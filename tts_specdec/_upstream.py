"""The one place that imports spear-tts, so its import-time log noise and progress bars stay quiet."""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from typing import Iterator

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    _previous = logging.root.manager.disable
    logging.disable(logging.INFO)  # fairseq logs "Please install tensorboardX" at import
    try:
        import spear_tts_pytorch.spear_tts_pytorch as _spear
        from spear_tts_pytorch import TextToSemantic
    finally:
        logging.disable(_previous)

__all__ = ["TextToSemantic", "quiet_progress"]


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """Silence the tqdm bar that `TextToSemantic.generate` draws for every call."""
    original = _spear.tqdm
    _spear.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        _spear.tqdm = original
