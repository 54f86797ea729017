"""Argument checks: bad input fails early with a ValueError/TypeError that names the argument."""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import os
from typing import TYPE_CHECKING, Iterator, Sequence

import torch
from torch import Tensor

from ._upstream import TextToSemantic

if TYPE_CHECKING:
    from .decoder import Decoder


def prepare_source(
    model: TextToSemantic, source: Tensor | Sequence[str], source_type: str = "text", *, strict: bool = True
) -> Tensor:
    """Strings or padded ids -> a checked LongTensor (batch, n) on the model's device.

    strict: refuse empty texts, rows of padding only, padding before a token (right padding only) and
    the source EOS id inside a source; spear-tts itself takes them (the drop-in `generate` passes
    strict=False)."""
    if isinstance(source, str):
        raise TypeError("source must be a list of strings or a LongTensor (batch, n), not a single str")
    if isinstance(source, (list, tuple)):
        if not source or not all(isinstance(s, str) for s in source):
            raise TypeError("source must be a non-empty list of strings or a LongTensor (batch, n)")
        if model.tokenizer_encode is None:
            raise ValueError("source is a list of strings but the model has no tokenizer (tokenizer_encode)")
        for i, text in enumerate(source):
            if strict and not text.strip():
                raise ValueError(f"source[{i}] is empty")
        source = model.tokenizer_encode(list(source))
    if not isinstance(source, Tensor):
        raise TypeError(f"source must be a list of strings or a LongTensor, got {type(source).__name__}")
    if source_type == "speech" and source.is_floating_point():
        if model.wav2vec is None:
            raise ValueError("source is a waveform but the model has no wav2vec to turn it into ids")
        source = model.wav2vec(source.to(model.device))
    if source.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise TypeError(f"source must hold integer token ids, got dtype {source.dtype}")
    if source.ndim != 2 or source.shape[0] == 0 or source.shape[1] == 0:
        raise ValueError(f"source must have shape (batch, n) with batch, n >= 1, got {tuple(source.shape)}")
    source = source.long().to(model.device)
    pad = model.pad_id[source_type]
    vocab = model.num_text_token_ids if source_type == "text" else model.num_semantic_token_ids
    if not strict:  # spear-tts takes any id its embedding has a row for (its source EOS id included)
        vocab = model.token_emb[source_type].num_embeddings
    real = source != pad
    bad = real & ((source < 0) | (source >= vocab))
    if bad.any():
        row, col = bad.nonzero()[0].tolist()
        raise ValueError(f"source[{row}, {col}] = {int(source[row, col])} is outside the {source_type} vocabulary [0, {vocab})")
    empty = ~real.any(dim=1)
    if not strict:
        return source
    if empty.any():
        raise ValueError(f"source row {int(empty.nonzero()[0])} is empty (only padding id {pad})")
    if (real[:, 1:] & ~real[:, :-1]).any():
        raise ValueError(f"source rows must be right-padded with {pad}; found a token after padding")
    return source


def check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {value}")
    return int(value)


def check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):  # NaN passes every range check written as a comparison
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def check_compile(compile: object) -> bool | str:
    """`compile`: False (the default path), True (inductor) or the name of a registered torch.compile
    backend; an unknown name is refused here rather than at the first compiled step."""
    if not isinstance(compile, (bool, str)):
        raise TypeError(f"compile must be a bool or a torch.compile backend name, got {type(compile).__name__}")
    if isinstance(compile, str):
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=())
        if compile not in known:
            raise ValueError(f"compile must be True, False or a torch.compile backend ({', '.join(known)}), "
                             f"got {compile!r}")
    return compile


def check_draft_cond_scale(value: object, cond_scale: float, gamma: int | None = None) -> float | None:
    """`draft_cond_scale`: None, or a scale >= 1 for a draft that is guided (cond_scale > 1, and gamma > 0
    where the caller drafts only then; gamma None: it always drafts)."""
    if value is None:
        return None
    value = check_cond_scale("draft_cond_scale", value)
    if cond_scale == 1 or gamma == 0:
        needs = "cond_scale > 1" if gamma is None else "gamma > 0 and cond_scale > 1"
        raise ValueError(f"draft_cond_scale needs {needs} (it guides the draft)")
    return value


# Guidance mixes null + (cond - null) * cond_scale: past ~100 a logit gap of 1 is worth 100 nats and the
# softmax is one-hot already, and near 1e37 the float32 mix overflows to inf (all-zero tokens, silently).
MAX_COND_SCALE = 100.0
# Beam scores are divided by length**length_penalty (Python floats): within +-10 that stays far inside
# float64 for any length a cache can hold; 1e300 overflowed in the middle of a search.
MAX_LENGTH_PENALTY = 10.0


def check_cond_scale(name: str, value: object) -> float:
    value = check_float(name, value)
    if not 1 <= value <= MAX_COND_SCALE:
        raise ValueError(f"{name} must be in [1, {MAX_COND_SCALE:g}], got {value}")
    return value


def check_length_penalty(value: object) -> float:
    value = check_float("length_penalty", value)
    if not -MAX_LENGTH_PENALTY <= value <= MAX_LENGTH_PENALTY:
        raise ValueError(f"length_penalty must be in [{-MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], got {value}")
    return value


def check_common(
    model: TextToSemantic, *, max_length: object, cond_scale: object, progress: object = None
) -> tuple[int, float]:
    """The arguments every decoding mode takes; `progress` (None or a callable) is checked before any
    decoding, not where the loop first calls it."""
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be None or a callable taking the length, got {type(progress).__name__}")
    max_length = check_int("max_length", max_length, 1)
    cond_scale = check_cond_scale("cond_scale", cond_scale)
    if cond_scale > 1 and model.cond_drop_prob == 0:
        raise ValueError("cond_scale > 1 needs a model trained with cond_drop_prob > 0 (classifier-free guidance)")
    return max_length, cond_scale


# ---- sizes: checked before anything is allocated ---------------------------------------------
# A size past these ceilings is taken for a mistake (10**6 typed for 10**1) and refused; past what the
# call can use it is lowered only where the result provably stays the same (`useful_gamma`,
# `check_draft_width`); what is left is checked against the device's memory (`check_memory`).

# Every beam is a row of every decoder pass and of the KV cache (16 KiB per position on the shipped
# model), and a step ranks beam_size x vocabulary candidates per item: 1024 beams cost about what a
# thousand plain decodes cost, per step. Results stop improving far below that (wide beams favour short,
# degenerate outputs: Stahlberg & Byrne 2019); the widest beam the tests and benchmarks use is 32 (an
# exhaustive search over a 3-token vocabulary, which is why the ceiling is not the vocabulary itself).
MAX_BEAM_SIZE = 1024
# A fixed gamma (drafts per cycle). A run of g drafts is kept whole with probability alpha^g: under 8% at
# g = 256 even for a draft that agrees 99% of the time, while every draft costs a draft step, a cache slot
# per row and, in speculative beam search, a tree level of draft_width nodes (the tree's masks grow with
# the square of gamma x draft_width). 256 units are 5 s of speech; gamma="auto" drafts at most 10.
MAX_FIXED_GAMMA = 256


def check_gamma(gamma: object, exit_layer: int | None) -> int | str:
    """An int in [0, MAX_FIXED_GAMMA], or "auto" (returned as is; `auto.AUTO`). An int > 0 needs a draft
    (an early-exit head); "auto" on a model without one is the caller's to resolve to 0."""
    if isinstance(gamma, str):
        if gamma != "auto":
            raise ValueError(f"gamma must be an int in [0, {MAX_FIXED_GAMMA}] or 'auto', got {gamma!r}")
        return gamma
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Integral):
        raise TypeError(f"gamma must be an int or 'auto', got {type(gamma).__name__}")
    gamma = check_int("gamma", gamma, 0, MAX_FIXED_GAMMA)
    if gamma > 0 and exit_layer is None:
        raise ValueError(
            "gamma > 0 needs a draft: the model has no early-exit head (set target_early_exit_layer "
            "when building TextToSemantic), or the direction is not text -> speech"
        )
    return gamma


def useful_gamma(gamma: int, max_length: int) -> int:
    """The most drafts a cycle can use: a cycle emits its accepted drafts and one token more, so past
    max_length - 1 drafts every row has ended (speculative beam search already drafts no level past
    max_length). At least 1 for gamma > 0, which stays speculative. Lower gamma to it only where gamma
    cannot change the result: greedy decoding and beam search (a seeded sampling run draws by gamma)."""
    return min(gamma, max(1, max_length - 1)) if gamma > 0 else 0


def check_beam_size(beam_size: object, vocab: int, upstream: bool) -> int:
    """An int in [1, MAX_BEAM_SIZE]; with spear-tts's beam semantics also at most the vocabulary."""
    beam_size = check_int("beam_size", beam_size, 1, MAX_BEAM_SIZE)
    if upstream and beam_size > vocab:
        raise ValueError(f"beam_size must be <= the vocabulary ({vocab}) with upstream beam semantics "
                         f"(every beam proposes beam_size tokens), got {beam_size}")
    return beam_size


def default_draft_width(beam_size: int) -> int:
    """Speculative beam search's draft width when the caller gives none: beam_size + ceil(beam_size / 4)
    (callers lower it to beam_size x vocabulary with `check_draft_width`). A level of K nodes must hold
    all K of the target's next beams for a cycle to commit a second step; a few more nodes raise the odds
    of that for little: at width 512 with 4 beams and gamma 1, widths 5 and 6 committed 1.57 and 1.62
    steps a cycle against width 4's 1.42, and ran 3-7% faster (docs/performance-log.md), while width 8's
    larger verify pass lost what it gained."""
    return beam_size + -(-beam_size // 4)


def check_draft_width(draft_width: object, beam_size: int, vocab: int) -> int | None:
    """None (the caller's default), or an int >= beam_size, lowered to beam_size x vocabulary: a draft
    level has no more candidates than that, so a wider one keeps the same nodes (the same search)."""
    if draft_width is None:
        return None
    return min(check_int("draft_width", draft_width, beam_size), beam_size * vocab)


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory on `device`: a GPU's total memory; for the CPU the machine's physical memory, or
    its container's limit (cgroup v2 or v1) where that is lower. None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return _host_memory() if device.type == "cpu" else None


@functools.lru_cache(maxsize=1)
def _host_memory() -> int | None:
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX
        return None
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) or a value past the machine's (v1): no limit
            memory = min(memory, int(text))
    return memory


def check_memory(dec: "Decoder", planned: dict[str, int], sizes: str) -> None:
    """Refuse a call whose planned tensors (name -> bytes: the KV cache, speculative beam search's draft
    tree) together exceed the device's memory, before any of them is allocated. `sizes`: the arguments
    they grow with, as `name=value, ...`, for the message. A plan is what a call allocates up front: a
    cache grows later only as rows get longer, so max_length is not held against it."""
    limit = device_memory(dec.device)
    total = sum(planned.values())
    if limit is None or total <= limit:
        return
    parts = " + ".join(f"{name} {_size(n)}" for name, n in planned.items() if n)
    raise ValueError(f"{sizes}: this call plans {_size(total)} ({parts}), more than the {_size(limit)} of memory "
                     f"of this {dec.device.type} device; lower one of them")


def _size(n: float) -> str:
    """Bytes as people read them: 512 B, 1.5 KiB, ..., 3.2 TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def walk(model: torch.nn.Module) -> tuple[list[torch.nn.Module], list[torch.nn.Parameter]]:
    """model.modules() and model.parameters(), each once and in torch's order, from one walk: a decode
    call needs both (eval mode, `Decoder.begin`), and one walk with bound methods and empty-dict skips
    costs a fraction of torch's two (it runs on every call; the shipped model has 579 modules)."""
    modules: list[torch.nn.Module] = []
    params: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    seen_params: set[int] = set()
    stack = [model]
    pop, push, add_module, add_param = stack.pop, stack.extend, modules.append, params.append
    while stack:
        m = pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        add_module(m)
        if m._parameters:
            for p in m._parameters.values():
                if p is not None and id(p) not in seen_params:
                    seen_params.add(id(p))
                    add_param(p)
        if m._modules:
            push(reversed([c for c in m._modules.values() if c is not None]))  # pre-order, like torch
    return modules, params


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module, modules: Sequence[torch.nn.Module] | None = None) -> Iterator[None]:
    """Decode in eval mode and put every module back as it was. Only modules in training mode are
    switched (model.eval() and model.train() each walk all modules, a visible share of decoding a
    sentence on a small model), and each gets its own flag back, mixed modes included.
    `modules`: model.modules() when the caller has them (`walk`)."""
    training = [m for m in (model.modules() if modules is None else modules) if m.training]
    for m in training:
        m.training = False
    try:
        with torch.inference_mode():
            yield
    finally:
        for m in training:
            m.training = True
