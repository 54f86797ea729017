"""tts_specdec: fast, exact decoding for Spear-TTS text-to-semantic.

The user's `spear_tts_pytorch.TextToSemantic` is the target; its early-exit head is the draft.
"""

from .api import SpeculativeDecoder
from .decoder import Decoder, Encoded
from .finite import NonFiniteLogits
from .cache import KVCache
from .results import Decoded, DecodeStats
from .generate import generate, patch, patched, unpatch

__all__ = ["SpeculativeDecoder", "Decoder", "Encoded", "KVCache", "NonFiniteLogits", "Decoded", "DecodeStats", "generate", "patch", "patched", "unpatch"]
