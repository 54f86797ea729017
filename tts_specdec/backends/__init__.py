"""Backends: how a `Decoder`'s layers and heads run. The search loops call the interface in `base.py`
and never ask which backend they are on; `select` chooses once per set of prepared weights.

    torch_eager.py       torch's ops, any device and dtype (the reference)
    kernels_cpu.py       the C++ kernels of csrc/ (float32, x86 CPUs with AVX2; the CPU default)
    static_compiled.py   static shapes for torch.compile / CUDA graphs (`compile=True`)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Backend
from .kernels_cpu import CpuKernels, fits
from .static_compiled import StaticCompiled
from .torch_eager import TorchEager

if TYPE_CHECKING:
    from ..decoder import Decoder

__all__ = ["Backend", "CpuKernels", "StaticCompiled", "TorchEager", "select"]


def select(dec: Decoder) -> Backend:
    """The backend for `dec`'s prepared weights (call after preparing them): static compiled steps when
    `dec.compile` asks for them, else the kernels where every product was packed for them, else torch's
    ops. The only place that decides."""
    if dec.compile:
        return StaticCompiled(dec, "inductor" if dec.compile is True else dec.compile)
    return CpuKernels(dec) if fits(dec) else TorchEager(dec)
