"""Shared tiny models and reference computations for the decoding tests.

Models are random TextToSemantic instances whose matrices are re-drawn from N(0, 0.5^2), so logits
are far from uniform and greedy outputs vary from token to token and from source to source.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tts_specdec._upstream import TextToSemantic, quiet_progress

REPO = Path(__file__).resolve().parents[1]


def load_script(relative: str, name: str | None = None) -> ModuleType:
    """A script of tools/ or recipes/ (no package) loaded as a module `name` (default: its file's stem),
    e.g. load_script("tools/gpu_check.py"); registered in sys.modules unless a module of that name is,
    since its dataclasses look their module up there."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module

TEXT_VOCAB = 20
SEMANTIC_VOCAB = 12


def make_model(
    seed: int = 0,
    *,
    dim: int = 32,
    heads: int = 2,
    dim_head: int = 16,
    kv_heads: int | None = None,
    source_depth: int = 1,
    target_depth: int = 4,
    exit_layer: int | None = 2,
    semantic_vocab: int = SEMANTIC_VOCAB,
    eos: bool = True,
    cond_drop_prob: float = 0.0,
    dtype: torch.dtype = torch.float32,
    std: float = 0.5,
    **kwargs,
) -> TextToSemantic:
    """A tiny TextToSemantic in eval mode with every matrix re-drawn from N(0, std^2)."""
    torch.manual_seed(seed)
    model = TextToSemantic(
        dim,
        source_depth=source_depth,
        target_depth=target_depth,
        num_text_token_ids=TEXT_VOCAB,
        num_semantic_token_ids=semantic_vocab,
        dim_head=dim_head,
        heads=heads,
        target_kv_heads=kv_heads,
        ff_mult=2,
        autoset_semantic_eos_id=eos,
        target_early_exit_layer=exit_layer,
        cond_drop_prob=cond_drop_prob,
        **kwargs,
    )
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, std)
    return model.to(dtype).eval()


def make_source(batch: int, length: int, seed: int = 0, lengths: list[int] | None = None) -> torch.Tensor:
    """Random text ids in [1, TEXT_VOCAB) (0 is the pad id), right-padded to `lengths` per row."""
    g = torch.Generator().manual_seed(seed)
    source = torch.randint(1, TEXT_VOCAB, (batch, length), generator=g)
    for row, n in enumerate(lengths or []):
        source[row, n:] = 0
    return source


def upstream_generate(model: TextToSemantic, source: torch.Tensor, **kwargs) -> list[torch.Tensor]:
    """spear-tts generate(), rows with EOS and the -1 padding after it stripped."""
    with quiet_progress():
        out = model.generate(source, source_type="text", target_type="speech", **kwargs)
    eos = model.eos_id["speech"] if model.autoset_eos_id["speech"] else None
    rows = []
    for row in out:
        row = row[row != model.semantic_pad_id]
        if eos is not None and (row == eos).any():
            row = row[: int((row == eos).nonzero()[0])]
        rows.append(row)
    return rows


def forward_logits(model: TextToSemantic, source: torch.Tensor, target: torch.Tensor, *, null: bool = False):
    """Upstream full forward: logits (b, n + 1, V) for every prefix of `target`, conditioned or null.

    cond_drop_prob=1 makes forward drop the condition for every row (its spear-tts null pass);
    cond_drop_prob=0 never drops it.
    """
    with torch.no_grad():
        return model(
            source, target, source_type="text", target_type="speech", cond_drop_prob=1.0 if null else 0.0
        )


def sequence_table(
    model: TextToSemantic, source: torch.Tensor, max_length: int, vocab: int, *, null: bool = False
) -> dict:
    """Log-probs of every token after every prefix up to max_length - 1, for one source row (1, n).

    Returns {prefix tuple: log-prob vector (vocab,)} computed with upstream forward on all sequences
    of length max_length - 1 over `vocab` tokens (EOS included: prefixes past an EOS are just unused).
    `null` gives the unconditioned (source dropped) log-probs instead.
    """
    seqs = list(itertools.product(range(vocab), repeat=max_length - 1))
    full = torch.tensor(seqs, dtype=torch.long).reshape(len(seqs), max_length - 1)
    logp = forward_logits(model, source.expand(full.shape[0], -1), full, null=null).log_softmax(dim=-1)
    table = {}
    for row, seq in enumerate(full.tolist()):
        for n in range(max_length):
            table.setdefault(tuple(seq[:n]), logp[row, n])
    return table


def tv_bound(categories: int, samples: int, delta: float = 1e-6) -> float:
    """High-probability bound on the total variation between an empirical and its true distribution.

    E[TV] = 1/2 sum_i E|p^_i - p_i| <= 1/2 sum_i sqrt(p_i (1 - p_i) / N) <= 1/2 sqrt(K / N)
    (Jensen, then Cauchy-Schwarz over the K categories). TV moves by at most 1/N when one sample
    changes, so McDiarmid gives P(TV > E[TV] + t) <= exp(-2 N t^2); t = sqrt(log(1/delta) / (2N)).
    With delta = 1e-6 a correct sampler exceeds the bound once in a million seeds.
    """
    return 0.5 * math.sqrt(categories / samples) + math.sqrt(math.log(1 / delta) / (2 * samples))


def tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Total variation between empirical counts and a distribution of the same shape."""
    counts = counts.double().flatten()
    return 0.5 * float((counts / counts.sum() - probs.double().flatten()).abs().sum())


def uncompiled_graph(self, fn, device, **static):
    """`StaticCompiled._graph` without torch.compile: the step function itself, run with torch function
    dispatch off (its ops are the graph's, not the loop's: a test's torch function mode sees none)."""
    step = functools.partial(fn, **static)

    def run(*args):
        with torch._C.DisableTorchFunction():
            return step(*args)

    return run


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run faster on one thread than on busy cores fighting over a 32-wide matmul.
    Decoding test modules use it through `pytestmark`; other test modules keep torch's setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["mm", "split", "kernel"])
def layout(request, one_thread, monkeypatch):
    """Every layout of the decoder: torch's plain products and attention on every position; what torch
    runs on large models (forced here on tiny ones: two threads, no size floors): bmm over weight
    blocks, and padded tree rows packed to their real tokens; the kernels (float32 on CPU; other dtypes
    keep torch's path) on two threads: every product and each attention in one call, the products of
    padded tree rows on their real tokens only (`kernel`)."""
    import tts_specdec.backends.torch_eager as torch_eager
    import tts_specdec.kernels as kernels
    import tts_specdec.weights as weights

    monkeypatch.setattr(kernels, "ENABLED", request.param.startswith("kernel"))
    if request.param != "mm":
        torch.set_num_threads(2)
    if request.param == "split":
        monkeypatch.setattr(torch_eager, "_PACK_MIN_WORK", 0)
    if request.param == "split":
        monkeypatch.setattr(weights, "_SPLIT_MIN_ELEMENTS", 0)
    return request.param


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one); `make gpu-check` runs them")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
