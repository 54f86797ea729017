"""Optional CPU kernels for decoding a few tokens at a time: products, attention, whole layers.

A decode step multiplies 1-40 rows (a step, a verify pass, a speculative beam tree) by every weight
matrix, and MKL runs such skinny products far below the memory bandwidth. `csrc/small_gemm.cpp` packs
each matrix into groups of 16-column panels and streams them once per call over torch's own threads,
every tile of rows passing over a slab of weights while it is in L1, so a pass over many tokens reads
each weight once; AVX-512 tiles where the CPU has it, AVX2's elsewhere (`isa`). On a
small model the rest of a layer is dispatch (an attention call, rotary, cache writes and layout copies
as separate small kernels): `csrc/attention.cpp` does each attention in one call, and
`csrc/layers.cpp` (`Stack`) runs a range of layers without returning to Python, on weights checked once
and one workspace per call. `Head` is an output head in one call; `decode_steps` runs several decoding
steps (layers, head, pick, next embedding) in one call: a speculative cycle's draft phase, or a run of
plain sampling; `csrc/accept.cpp` is the speculative accept rule for all rows of a cycle in one call;
`csrc/fingerprint.cpp` checks parameters for changes. The raw-pointer cores are declared in
`csrc/kernels.h`. What this buys on the shipped model and at realistic sizes: docs/performance.md.

It is built with torch's C++ extension loader on first use (about 40 s with g++ and ninja, cached
under ~/.cache/torch_extensions/py310_cpu/tts_specdec_<digest> or $TORCH_EXTENSIONS_DIR) and used only for float32 on x86 CPUs with
AVX2. Anything else (no compiler, another device or dtype, `TTS_SPECDEC_KERNELS=0`) falls back to
torch's products and attention, which give the same results up to float rounding; `available()`
says which path runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import Tensor

try:
    import fcntl
except ImportError:  # not POSIX: torch's own lock file only
    fcntl = None

PANEL = 16
GROUP = 4  # panels per group (kGroup in csrc/kernels.h)
BLOCK = 32  # terms per slab (kBlock in csrc/kernels.h)
# read when weights are prepared (and part of what `Decoder.begin` compares); tests switch it
ENABLED = os.environ.get("TTS_SPECDEC_KERNELS", "1") != "0"
_SOURCES = [Path(__file__).with_name("csrc") / name for name in ("small_gemm.cpp", "attention.cpp", "accept.cpp", "beam.cpp", "cache_ops.cpp", "fingerprint.cpp", "layers.cpp")]
# included by the sources: torch does not see them, so their digest is a flag (a change rebuilds)
_HEADERS = [Path(__file__).with_name("csrc") / name for name in ("kernels.h", "gemm_tiles.inc")]
_module = None
_failed: str | None = None
_build_dir: Path | None = None  # where the loaded extension was built
log = logging.getLogger(__name__)


BUILD_WAIT_SECONDS = 900.0


def _build_directory(flags: list[str]) -> Path:
    """A build folder of its own per source digest, flags and torch version, under torch's extension
    root ($TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions): builds of other versions of this
    package never share (or wait on) one folder."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        root = os.path.join(get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_cpu")
    h = hashlib.sha1()
    # the sources' folder too: torch's build files name the sources by path, so two checkouts with the
    # same sources sharing one folder would rebuild it for each other on every first use
    for part in [torch.__version__, str(_SOURCES[0].parent.resolve()), *flags]:
        h.update(part.encode())
    for src in [*_SOURCES, *_HEADERS]:
        h.update(src.read_bytes())
    path = Path(root) / f"tts_specdec_{h.hexdigest()[:16]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Hold an flock on the build folder while torch builds or loads there.

    torch's loader guards a build with a plain `lock` file and waits for it to disappear, forever: a
    build killed mid-way (a SIGKILLed job, a machine shut down) leaves it behind and every later first
    use hangs. An flock is released by the kernel when its holder dies, so a `lock` file found while
    holding ours belongs to no live build of this folder and is removed. Waiting for a live build
    gives up after BUILD_WAIT_SECONDS (the caller falls back to torch's products)."""
    if fcntl is None:
        yield
        return
    fd = os.open(build_dir / "tts_specdec.flock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + BUILD_WAIT_SECONDS
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building {build_dir} for {BUILD_WAIT_SECONDS:.0f} s")
                time.sleep(0.2)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("tts_specdec: removing %s, left by a build that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the flock


def _load():
    """The compiled extension, or None (with the reason in `_failed`)."""
    global _module, _failed, _build_dir
    if _module is not None or _failed is not None:
        return _module
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        _failed = f"CPU capability {torch.backends.cpu.get_cpu_capability()} (needs AVX2)"
        return None
    if shutil.which("ninja") is None:  # the `ninja` dependency installs it beside this interpreter
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    try:
        ext_log = logging.getLogger("torch.utils.cpp_extension")
        level = ext_log.level
        ext_log.setLevel(logging.ERROR)  # "No CUDA runtime is found" on CPU-only machines
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from torch.utils.cpp_extension import load

                # torch rebuilds when the sources or flags change, not the header: its digest is a flag
                digest = hashlib.sha1(b"".join(h.read_bytes() for h in _HEADERS)).hexdigest()[:12]
                # -ffp-contract=off: only the FMAs the code writes. GCC otherwise fuses some of the
                # epilogues' mul + add pairs, depending on inlining, so a row's product could differ in
                # the last bit with the number of rows beside it (test_row_result_independent_of_batch)
                # -fopenmp: at::parallel_for is inline OpenMP in torch's headers, so without it every
                # kernel ran on one thread whatever torch.get_num_threads() said; linked as libgomp.so.1,
                # which resolves to the OpenMP runtime torch already loaded (one thread pool, torch's)
                flags = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", f"-DTTS_SPECDEC_HEADER={digest}"]
                build_dir = _build_dir = _build_directory(flags)
                with _build_lock(build_dir):
                    _module = load(
                        "tts_specdec_small_gemm", [str(p) for p in _SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                        build_directory=str(build_dir), verbose=False,
                    )
        finally:
            ext_log.setLevel(level)
    except Exception as e:  # no compiler, no headers: torch's products do the work
        _failed = f"build failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        log.warning("tts_specdec: small-product kernel unavailable (%s); using torch's products", _failed)
    return _module


def available(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> bool:
    """Whether products on `device` in `dtype` run on the kernel."""
    return ENABLED and torch.device(device).type == "cpu" and dtype == torch.float32 and _load() is not None


def unavailable_reason() -> str | None:
    """Why float32 CPU products do not run on the kernel, or None when they do."""
    if not ENABLED:
        return "disabled (TTS_SPECDEC_KERNELS=0)"
    _load()
    return _failed


def _slabs(w: Tensor) -> Tensor:
    """One group's float32 weights (in, panels x 16) as the kernel reads them, flattened: slab after slab
    of BLOCK terms (the last one shorter where `in` is not a multiple of BLOCK), each slab panel by panel,
    each panel's terms in order (16 weights each)."""
    rows, panels = w.shape[0], w.shape[1] // PANEL
    full = rows - rows % BLOCK
    whole = w[:full].reshape(full // BLOCK, BLOCK, panels, PANEL).permute(0, 2, 1, 3).reshape(-1)
    rest = w[full:].reshape(rows - full, panels, PANEL).permute(1, 0, 2).reshape(-1)
    return torch.cat([whole, rest])


class Packed:
    """A weight stored as (in, out) for `x @ w`, packed for the kernel: 16-column panels in groups of
    GROUP, each group slab by slab of BLOCK terms, so the kernel reads a slab as one run of memory and a
    thread's panels as one stream; within a slab float32 panels one after another (`_slabs`: a tile's
    pass over one panel reads one run of memory), bfloat16 panels term by term (term k of each panel side
    by side), the faster for each (csrc/kernels.h).
    `panels` has the shape (out / 16, in, 16) of the panels but that memory order: only the kernel
    reads it."""

    def __init__(self, w_t: Tensor, width: int | None = None, store: torch.dtype = torch.float32) -> None:
        """width: the columns that matter when w_t was padded with zeros to whole panels; products
        return a view of that many columns (bias and residual then have the padded width).
        store: the panels' dtype, float32 or bfloat16 (half the bytes to stream; each weight is rounded to
        bfloat16 once here, and a product widens it to float32 exactly and sums as with float32 panels)."""
        rows, cols = w_t.shape
        if cols % PANEL:
            raise ValueError(f"w_t: output width {cols} is not a multiple of {PANEL}")
        if store not in (torch.float32, torch.bfloat16):
            raise ValueError(f"store: float32 or bfloat16, not {store}")
        w = w_t.detach().to(store)
        pack = _slabs if store == torch.float32 else lambda g: g.contiguous().view(-1)  # (csrc/kernels.h)
        groups = [pack(w[:, c : c + GROUP * PANEL]) for c in range(0, cols, GROUP * PANEL)]
        self.panels = torch.cat(groups).view(cols // PANEL, rows, PANEL)
        self.width = cols if width is None else width

    @staticmethod
    def fits(w_t: Tensor) -> bool:
        return w_t.shape[1] % PANEL == 0 and available(w_t.device, w_t.dtype)

    def numel(self) -> int:
        return self.panels.numel()

    def __call__(
        self, x: Tensor, bias: Tensor | None = None, residual: Tensor | None = None, normalize: bool = False,
        geglu: bool = False,
    ) -> Tensor:
        """(x / ||x|| if normalize else x) @ w + bias + residual for x (tokens, in) -> (tokens, out),
        a new contiguous tensor. The row norm (F.normalize: max(||x||, 1e-12)) scales the sums.
        geglu: x is (tokens, 2 in) = [h | gate] and h * gelu(gate) (exact GELU) is multiplied instead."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        if residual is not None and residual.stride(-1) != 1:
            residual = residual.contiguous()
        y = _module.small_gemm(x, self.panels, bias, residual, normalize, geglu)
        return y if y.shape[1] == self.width else y[:, : self.width]


def self_attention(
    heads: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, slots: Tensor, k_cache: Tensor, v_cache: Tensor,
    mask: Tensor | None, keys: int, h: int, kvh: int,
) -> Tensor:
    """One decoder layer's self-attention for a few queries per row, in one call (csrc/attention.cpp).

    heads (rows * n, (h + 2 kvh) d): every token's q, k, v heads; cos/sin (P, d) the rotary tables
    (sign folded into sin, `Decoder._ensure_rope`); pos/slots (rows, n) int64: each token's rotary
    position and cache slot. Rotated k and v are written into k_cache/v_cache (rows, kvh, capacity, d)
    at the slots; each query then attends the slots <= its own, or, with `mask` (1 or rows, n, keys)
    additive, the first `keys` slots under that mask. Returns (rows * n, h d)."""
    return _module.self_attention(heads, cos, sin, pos, slots, k_cache, v_cache, mask, keys, h, kvh)


class Stack:
    """Decoder layers packed for `csrc/layers.cpp`, checked once; `run` takes a range of them in one call.

    weights: 8 per model layer: qkv, attn_out, cross_q, cross_out, ff_in, ff_in_bias, ff_out,
    ff_out_bias (`Packed.panels` for products, norms folded in); h, kvh, d: heads, kv heads, dim_head."""

    def __init__(self, weights: list[Tensor], h: int, kvh: int, d: int) -> None:
        self._stack = _module.Stack(weights, h, kvh, d)

    def run(
        self, x: Tensor, layers: range, cos: Tensor, sin: Tensor, pos: Tensor, slots: Tensor, k_all: Tensor,
        v_all: Tensor, table: Tensor | None, mask: Tensor | None, keys: int, enc_keys: Tensor, enc_values: Tensor,
        cross_mask: Tensor | None, enc_rows: Tensor | None = None, real: Tensor | None = None,
    ) -> Tensor:
        """Layers `layers` (a contiguous range) on x (tokens, dim), each: normalised q/k/v product,
        `self_attention`, output product + residual, normalised cross q product, `cross_attention`,
        output product + residual, feed-forward (normalised input product, GEGLU output product + residual).

        pos/slots (rows, n) as in `self_attention`; k_all/v_all: the whole cache (layers, rows, kvh,
        capacity, d); table (rows, capacity) int64 or None: the cache row each slot is read from (a
        `KVCache` by reference; the cache may then hold more rows than are decoded); enc_keys/enc_values
        (layers, sources, h, S, d): row r reads source enc_rows[r] ((rows,) int64; None: source r);
        cross_mask (rows, S) additive. real ((T,) int64, increasing, or None): the tokens whose outputs
        matter when rows are padded; the products run on those only (padding tokens: zero q, k, v and
        zero outputs), the real tokens' results unchanged."""
        return self._stack.run(x, layers.start, layers.stop, cos, sin, pos, slots, k_all, v_all, table, mask, keys,
                               enc_keys, enc_values, cross_mask, enc_rows, real)


class Head:
    """An output head in one call (csrc/layers.cpp): optionally x + ff(x) first (ff: w_in, b_in, w_out,
    b_out as `Stack` takes a layer's feed-forward), then the normalised product with w_out (`Packed`)."""

    def __init__(self, ff: list[Tensor], w_out: "Packed") -> None:
        self._head = _module.Head(ff, w_out.panels, w_out.width)

    def __call__(self, h: Tensor) -> Tensor:
        """h (tokens, dim) -> logits (tokens, width)."""
        return self._head(h if h.stride(-1) == 1 else h.contiguous())


def decode_steps(
    stack: Stack, head: Head, emb: Tensor, x0: Tensor, layers: range, start: Tensor, steps: int, temperature: float,
    generator: torch.Generator | None, cos: Tensor, sin: Tensor, k_all: Tensor, v_all: Tensor, enc_keys: Tensor,
    enc_values: Tensor, cross_mask: Tensor | None, *, top_k: int | None = None, top_p: float | None = None,
    guidance: float = 0.0, confidence: float | None = None, eos: int | None = None, tail: bool = False,
    enc_rows: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor, Tensor | None, Tensor]:
    """Up to `steps` decoding steps per row in one call (csrc/layers.cpp): from x0 (rows, dim) at slots
    start (rows,), each step runs `layers` (from layer 0) and `head`, picks a token (greedy when
    temperature is 0, else drawn from softmax(logits / temperature), top_k- and top_p-filtered as
    `sampling.filter_logits` filters, by an exponential race drawn from `generator` as `sampling.draw`
    draws it: the same numbers in the same order as the step-by-step loop) and embeds it from emb as the
    next input. The draft phase of a speculative cycle (the trunk and exit head, tail=True: the last
    token's trunk pass too; confidence: a row stops proposing after a token its head gave less than that
    probability, the steps end when every row stopped) or a run of plain sampling (every layer and the
    target head; the steps end after one in which some row picked eos). guidance > 0: rows are (cond,
    null) pairs, one sequence each, their logits mixed as `sampling.cfg_mix` with that scale.
    Returns the layers' output at every position (rows, steps + 1, dim) with tail (else None), the
    distributions (seqs, steps, V) (None when greedy), the tokens (seqs, steps), with confidence each
    sequence's proposed count (seqs,), and the next input (rows, dim). Past a sequence's proposed count
    (its last draft's pass excepted) its rows run no pass: zero outputs, q and tokens 0 there (nothing
    reads them), zero K/V at those slots."""
    if layers.start != 0:
        raise ValueError("decode steps start at layer 0")
    exits, q, tokens, limit, x = _module.decode_steps(
        stack._stack, head._head, emb, x0, layers.stop, start, steps, temperature, top_k or 0, top_p or 0.0, guidance,
        confidence or 0.0, -1 if eos is None else eos, tail, generator, cos, sin, k_all, v_all, enc_keys, enc_values,
        cross_mask, enc_rows)
    return (exits if tail else None), (q if temperature > 0 else None), tokens, (limit if confidence else None), x


def beam_draft(
    stack: Stack, head: Head, emb: Tensor, x0: Tensor, t: Tensor, score: Tensor, items: int, levels: int, width: int,
    trunk: range, temperature: float, eos: int | None, cos: Tensor, sin: Tensor, k_all: Tensor, v_all: Tensor,
    enc_keys: Tensor, enc_values: Tensor, cross_mask: Tensor | None, enc_rows: Tensor | None = None,
    upper: range | None = None, ready: Tensor | None = None, table: Tensor | None = None, target: Head | None = None,
    carried: Tensor | None = None,
) -> tuple[Tensor | None, ...]:
    """A speculative beam cycle's draft tree in one call (csrc/layers.cpp, `spec_beam.draft` unguided):
    beam search with `head` over the layers `trunk` for `levels` levels of `width` nodes per item from the
    roots x0 (R, dim) at slots t (R,) with scores `score` (R,), R = items x beams, every node kept in its
    root's cache row under the tree mask; eos (or None) is never a node. Returns (hs (R, M, dim), anc
    (R, M, M), depth (R, M), count (R,), per node row, index, parent, token, path (N, levels), and last
    the outputs (N, dim) by node of the verify pass over every node through `upper` (the layers above the
    trunk; none: the exit states). ready (R,) bool: roots the verify pass skips, leaving their K/V at slot t
    as it is (already taken through every layer; their outputs are zero). table (R, capacity) int64: a
    cache by reference (`Stack.run`); the call makes the tree's slots t.. each row's own (`KVCache.claim`).
    target: the target's head, whose log-probs by node (`beam.step_logprobs`, unguided) come after the
    outputs (else None), a ready root's replaced by its row of `carried` (R, V) where given (then a ready
    root also skips the trunk, and its children are ranked by that row, not by `head`). Last, one int64
    tensor of what the caller reads on the host: row, parent, token, path flattened, count."""
    if trunk.start != 0 or (upper is not None and upper.start != trunk.stop):
        raise ValueError("the draft's trunk starts at layer 0, the verify pass where it ends")
    out = tuple(_module.beam_draft(
        stack._stack, head._head, emb, x0, t, score, items, levels, width, trunk.stop,
        trunk.stop if upper is None else upper.stop, temperature,
        -1 if eos is None else eos, cos, sin, k_all, v_all, enc_keys, enc_values, cross_mask, enc_rows, ready, table,
        None if target is None else target._head, carried))
    return out if target is not None else out[:-1] + (None, out[-1])


def beam_steps(
    stack: Stack, target: Head, emb: Tensor, x0: Tensor, t: int, limit: int, scores: Tensor, worst: Tensor, length: int,
    length_penalty: float, temperature: float, eos: int | None, layers: range, cos: Tensor, sin: Tensor, k_all: Tensor,
    v_all: Tensor, table: Tensor, enc_keys: Tensor, enc_values: Tensor, cross_mask: Tensor | None,
    enc_rows: Tensor | None = None, ended: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Plain beam search steps in one call (csrc/layers.cpp; unguided, a cache by reference `table`) from
    x0 (R, dim) at slot t of every row, while each step needs no decision: standard semantics, its new
    beams are its K best candidates (none EOS or non-finite, no item possibly done against `worst`
    (items,) float64, the worst finished score of an item with K finished hypotheses, else -inf);
    spear-tts's (`ended` (R,) bool given, updated in place), no NaN log-probs and not every beam ended.
    The step `limit` steps on is never taken. Returns (parents and tokens of the steps taken (taken, 2,
    R), the scores after them (items, K) float64, the next inputs (R, 1, dim), the log-probs (R, V) of
    the step that stopped the call, already through the layers, or None where the cache's capacity did)."""
    if layers.start != 0:
        raise ValueError("beam steps start at layer 0")
    steps, scores, x, pending = _module.beam_steps(
        stack._stack, target._head, emb, x0, t, limit, scores, worst, length, length_penalty, temperature,
        -1 if eos is None else eos, layers.stop, cos, sin, k_all, v_all, table, enc_keys, enc_values, cross_mask, enc_rows,
        ended)
    return steps, scores, x, pending


def filtered_probs(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None) -> Tensor:
    """softmax(logits / temperature) after top-k and top-p as `sampling.filter_logits` filters them, for
    logits (rows, V) float32 on the CPU, in one call (csrc/layers.cpp, shared with the draft phase)."""
    return _module.filtered_probs(logits, temperature, top_k or 0, top_p or 0.0)


def fingerprint(tensors: list[Tensor]) -> list[int] | None:
    """Two 64-bit sums of each tensor's bytes (csrc/fingerprint.cpp: any one changed word changes the
    first, moved words the second), flattened; None without the kernels or unless all are on the CPU."""
    # a GPU model never loads (or builds) the extension for this
    if not ENABLED or any(t.device.type != "cpu" for t in tensors) or _load() is None:
        return None
    sums = _module.fingerprint(tensors)
    return None if sums is None else sums.view(-1).tolist()


def commit_beams(
    k: Tensor, v: Tensor, table: Tensor | None, high: int, source: list[int], rows: list[int], src: list[int],
    dst: list[int], lengths: list[int], tokens: list[int], node: list[int], scores: list[float], emb: Tensor,
    logprobs: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """A speculative beam cycle's commit in one call (csrc/cache_ops.cpp), on the float32 CPU cache buffers
    k, v (layers, R, heads, capacity, d) and slot table (or None): the cache's rows become rows `source` of
    the old ones, then within new row rows[i] the R x s slots src move to dst (as `move_slots`). Returns,
    by new row: its pending input's slot t (its item's `lengths` entry: also the cache's new lengths), x
    (R, 1, dim) = emb[tokens], the scores (R,) float32 (new beam i's at row rows[i]), and where some node
    is >= 0, ready = node >= 0 and carried = logprobs[node] (else None, None)."""
    return tuple(_module.commit_beams(k, v, table, high, source, rows, src, dst, lengths, tokens, node, scores, emb, logprobs))


def reorder_rows(t: Tensor, index: Tensor, high: int) -> None:
    """In place: rows r < n of a cache buffer t (layers, rows, heads, capacity, d), float32 CPU with
    contiguous slots, become rows index[r] (index (n,), n <= rows), slots below `high`; unmoved rows and
    rows from n on are not touched."""
    _module.reorder_rows(t, index, high)


def move_slots(bufs: list[Tensor], rows: Tensor, src: Tensor, dst: Tensor, table: Tensor | None = None) -> None:
    """In place: within row rows[i] of cache buffers (layers, rows, heads, capacity, d), every layer's and
    head's slots src[i] are copied to slots dst[i] ((n, s) int64), all read before any is written. table
    (rows', capacity) int64, a cache by reference: slot src[i, j] is read from the row the table names, and
    the table then names row rows[i] at its slots dst[i]."""
    _module.move_slots(bufs, rows, src, dst, table)


def cross_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """q (rows * n, h d) over keys/values (rows, h, S, d) with an additive mask (rows, S) -> (rows * n, h d)."""
    return _module.cross_attention(q, keys, values, mask)


def _dense(t: Tensor | None) -> Tensor | None:
    """t as the C++ calls read it: contiguous (None stays None)."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def verify_accept(
    head: Head, emb: Tensor, h: Tensor, drafts: Tensor, q: Tensor | None, limit: Tensor | None, temperature: float,
    top_k: int | None, top_p: float | None, generator: torch.Generator | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """A speculative sampling cycle after its verify pass, unguided, in one call (csrc/layers.cpp): the
    target `head` on h (rows * (gamma + 1), dim), the accept rule (greedy when temperature is 0; else
    `sampling.speculative_accept` on p as `sampling.probabilities` makes it, its random numbers drawn from
    `generator` as the step-by-step path draws them), the read-back of `speculative._cycles` (rows, 2 +
    (gamma + 1) + gamma [+ 1]) float64, the next input (rows, 1, dim) from emb and each row's advance
    (rows,). The same numbers as those torch operations on the kernels, so the same tokens."""
    c = _dense
    return tuple(_module.verify_accept(
        head._head, emb, h if h.stride(-1) == 1 else h.contiguous(), c(drafts), c(q), c(limit), temperature,
        top_k is not None or top_p is not None, top_k or 0, top_p or 0.0, generator))


def speculative_accept(
    p: Tensor, q: Tensor, drafts: Tensor, u: Tensor, race: Tensor, limit: Tensor | None
) -> tuple[Tensor, Tensor]:
    """`sampling.speculative_accept`'s rule in one call (csrc/accept.cpp) on the same random numbers:
    u (rows, gamma) uniforms and race (rows, V) Exp(1) draws. Returns (accepted, next_token)."""
    c = _dense
    return tuple(_module.speculative_accept(c(p), c(q), c(drafts), c(u), c(race), None if limit is None else c(limit)))


def beam_top(
    scores: Tensor, logprobs: Tensor, rows: list[int] | None, n: int
) -> tuple[list[list[float]], list[list[int]], Tensor, Tensor, Tensor] | None:
    """A beam step's ranking in one call (csrc/beam.cpp): per item the n best of scores (a, k) float64
    (cast to logprobs' dtype) + log-probs of each beam's row (`rows`, None: row r for beam r) of logprobs
    (N, V), NaN first as torch.topk, ties to the lower flat index; then the k best as new beams' rows and
    tokens (a * k,) and scores (a, k) float64. None where it does not run: not the CPU, a dtype other than
    float32/float64, or no extension (`beam.beam_step` then ranks with torch.topk)."""
    if (not ENABLED or logprobs.device.type != "cpu" or logprobs.dtype not in (torch.float32, torch.float64)
            or _load() is None):
        return None
    if logprobs.stride(-1) != 1:
        logprobs = logprobs.contiguous()
    return _module.beam_top(scores.contiguous(), logprobs, [] if rows is None else rows, n)


def isa(name: str = "") -> str:
    """The tiles the products run on, "avx512" where the CPU has AVX-512 (faster at every row count on
    the AMD EPYC we measured, `csrc/small_gemm.cpp`), else "avx2"; TTS_SPECDEC_ISA=avx2 starts with AVX2's.
    `name` ("avx2", "avx512", or "auto": the widest the CPU has) switches it for this process. Both sum in
    the same order and give the same bits."""
    if _load() is None:
        raise RuntimeError(f"the CPU kernels do not run here: {unavailable_reason()}")
    return _module.set_isa(name)
