"""Attention masks as the layers take them. Below both the decoder adapter (the source mask) and the
backends (a caller's boolean mask): neither imports the other for it."""

from __future__ import annotations

import torch
from torch import Tensor


def additive(mask: Tensor | None, dtype: torch.dtype, *, test_all: bool = True) -> Tensor | None:
    """Boolean attention mask (True = attend) -> additive float mask (0 or -inf), built once instead of inside
    every layer's attention call. None when nothing is masked, found with a read-back; `test_all=False`
    skips that test (a caller that knows some key is hidden, or sized the mask itself)."""
    if mask is None or (test_all and bool(mask.all())):
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
