"""Side-by-side decoding benchmark: spear-tts's own generate() against every tts_specdec mode.

All modes run in one process on the same model and inputs, in interleaved repetitions (mode A, B, C,
A, B, C, ...) so that machine noise hits them alike; the table reports median tokens/s and ratios
measured within this run. Speed claims come from here, never from unit tests. Speculative rows also
show alpha, the measured cost c of a draft step and v of a verify pass (both in plain target steps),
Leviathan et al.'s bound (v = 1), the bound at the measured v, and the bound at v with every draft
accepted: the most any draft of this cost could give on this machine.

    python recipes/benchmark.py                      # random-init reference model (dim 256), batch 1
    python recipes/benchmark.py --model default      # the shipped checkpoint (trained exit head)
    python recipes/benchmark.py --json bench.json --reps 5 --threads 2
    python recipes/benchmark.py --model default --sentences 10 --count-ops   # torch ops per token instead
    python recipes/benchmark.py --model default --widen 512 8 --sentences 24 --families sample greedy
    python recipes/benchmark.py --model default --device cuda --compile   # static steps, CUDA graphs

--count-ops times nothing: it runs every mode --reps times on torch's path (the GPU's path: the CPU kernels
off) and counts the torch ops dispatched per generated token. Where each op costs the host a launch of
a few microseconds, as on a GPU at batch 1 with this small model, a decode runs at the pace of its ops,
so the ratio of op counts is the speedup that such a machine can approach (docs/performance.md has the
GPU figures). A ceiling, not a measured speed.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tts_specdec import SpeculativeDecoder  # noqa: E402
from tts_specdec._upstream import TextToSemantic, _spear, quiet_progress  # noqa: E402
from tts_specdec.results import DecodeStats  # noqa: E402
from tts_specdec.distill import distill_exit_head  # noqa: E402
from tts_specdec.inputs import MAX_BEAM_SIZE, MAX_FIXED_GAMMA, default_draft_width  # noqa: E402
from tts_specdec.speech import cli  # noqa: E402
from tts_specdec.speech.atomic import write_json  # noqa: E402  (the tools import it from here too)


@dataclass
class Mode:
    name: str
    run: Callable[[], tuple[int, DecodeStats | None]]  # -> (generated tokens, our stats or None)
    baseline: str | None = None  # ratio is reported against this mode
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    stats: DecodeStats | None = None
    warmup_s: float | None = None  # the first call: compilation and CUDA graph capture under --compile

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(n / t for n, t in zip(self.tokens, self.times))


@dataclass
class Setup:
    model: TextToSemantic
    sources: list[torch.Tensor]  # decoded one after another; each a padded (batch, n) tensor
    max_lengths: list[int]
    description: str


def reference_model(seed: int, device: str, distill_steps: int) -> Setup:
    """A random-init reference model: dim 256, source depth 4, target depth 8, 4 heads of 64,
    512 semantic ids, 60 text tokens in, 200 out, EOS disabled; exit head after layer 2, briefly
    distilled toward the model's own final head so speculative rows have a meaningful draft."""
    torch.manual_seed(seed)
    model = TextToSemantic(
        dim=256, source_depth=4, target_depth=8, heads=4, dim_head=64, num_text_token_ids=256,
        num_semantic_token_ids=512, autoset_semantic_eos_id=False, target_early_exit_layer=2,
    ).to(device).eval()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    source = torch.randint(1, 256, (1, 60), generator=gen).to(device)
    if distill_steps:
        distill_exit_head(model, source_len=60, steps=distill_steps, seq_len=200, seed=seed)
    return Setup(model, [source], [200], f"random-init reference model (dim 256), exit head distilled {distill_steps} steps")


def tool_parser(doc: str, sentences: int = 8, reps: int = 3) -> argparse.ArgumentParser:
    """The options the side-by-side tools share (tools/spec_beam_bound.py, tools/dtype_speed.py): the model
    (the shipped one widened, 512 wide by default), the held-out sentences, interleaved passes, threads."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widen", type=int, nargs="+", default=[512, 8], metavar="N", help="DIM HEADS [DEPTH]; 0: shipped size")
    p.add_argument("--sentences", type=int, default=sentences)
    p.add_argument("--reps", type=int, default=reps)
    p.add_argument("--threads", type=int, default=2)
    return p


def default_model(
    device: str, checkpoint: Path | None = None, batch: int = 1, sentences: int = 1, widen: list[int] | None = None
) -> Setup:
    """The shipped checkpoint (or another speech checkpoint directory) on held-out-style sentences:
    one batch of `batch` fixed sentences, or `sentences` > 1 held-out corpus sentences in batches of
    `batch` (1: one at a time).
    widen: [dim, heads] or [dim, heads, depth]: the same function at that size (`tts_specdec.widen`)."""
    from tts_specdec.speech.checkpoint import load_checkpoint
    from tts_specdec.speech.pipeline import ASSETS, default_max_length
    from tts_specdec.speech.references import heldout_sentences
    from tts_specdec.widen import widen as widened

    ckpt = load_checkpoint(checkpoint or ASSETS)
    name = f"checkpoint {checkpoint}" if checkpoint else "shipped checkpoint"
    if widen:
        ckpt = widened(ckpt, *widen)
        params = sum(p.numel() for p in ckpt.model.parameters()) / 1e6
        name += (f" widened function-preservingly to dim {ckpt.config.dim}, {ckpt.config.heads} heads, "
                 f"{ckpt.config.target_depth} target layers ({params:.0f}M parameters)")
    model = ckpt.model.to(device).eval()
    if sentences > 1:
        texts = heldout_sentences(sentences)
        sources = [model.tokenizer_encode(texts[i : i + batch]).to(device) for i in range(0, sentences, batch)]
        alone = "each alone (batch 1)" if batch == 1 else f"in batches of {batch}"
        what = f"{sentences} held-out corpus sentences, {alone}, times and tokens summed"
    else:
        texts = list(HELD_OUT_TEXTS[:batch])
        sources = [model.tokenizer_encode(texts).to(device)]
        what = f"batch {batch}: {texts!r}"
    # the pipeline's length cap: spear-tts beam search only stops when every beam has emitted EOS
    return Setup(model, sources, [default_max_length(s) for s in sources], f"{name}, {what}")


HELD_OUT_TEXTS = (
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Seven ships sailed north before the storm reached the harbour.",
    "Please call me back after four o'clock tomorrow.",
    "A quiet garden grows behind the old stone library.",
)


def build_modes(setup: Setup, args: argparse.Namespace) -> list[Mode]:
    model, inputs = setup.model, list(zip(setup.sources, setup.max_lengths))
    dec = SpeculativeDecoder(model, compile=args.compile)
    gen = torch.Generator(device=setup.sources[0].device).manual_seed(args.seed)
    k, g = args.beam_size, args.gamma
    has_exit = dec.decoder.exit_layer is not None

    def kept_tokens(out: torch.Tensor) -> int:
        eos = model.eos_id["speech"] if model.autoset_eos_id["speech"] else None
        keep = out != model.semantic_pad_id
        if eos is not None:
            keep &= (out == eos).cumsum(dim=-1) == 0
        return int(keep.sum())

    def upstream(**kw: object) -> Callable[[], tuple[int, None]]:
        def run() -> tuple[int, None]:
            with quiet_progress():
                outs = [model.generate(src, source_type="text", target_type="speech", max_length=n, **kw)
                        for src, n in inputs]
            return sum(kept_tokens(out) for out in outs), None
        return run

    def ours(method: str, **kw: object) -> Callable[[], tuple[int, DecodeStats]]:
        def run() -> tuple[int, DecodeStats]:
            stats = DecodeStats.total([getattr(dec, method)(src, max_length=n, **kw).stats for src, n in inputs])
            return stats.generated_tokens, stats
        return run

    t = args.temperature
    # the sampling and greedy rows: --top-k / --top-p filter both sides alike (spear-tts: its top_k / top_p
    # filter; without either spear-tts keeps its default filter, top 10% of the vocabulary, and ours none)
    up_kw: dict = {"cond_scale": args.cond_scale}
    if args.top_k:
        up_kw["filter_fn_kwargs"] = {"k": args.top_k}
    if args.top_p:
        up_kw.update(filter_logits_fn=_spear.top_p, filter_fn_kwargs={"thres": args.top_p})
    sk = dict(temperature=t, generator=gen, top_k=args.top_k or None, top_p=args.top_p or None, cond_scale=args.cond_scale)
    gk = dict(temperature=0.0, cond_scale=args.cond_scale)
    modes = [] if args.skip_upstream else [Mode("spear-tts generate (sampling)", upstream(temperature=t, **up_kw))]
    modes.append(Mode("ours sample", ours("sample", gamma=0, **sk), None if args.skip_upstream else "spear-tts generate (sampling)"))
    if has_exit:
        modes.append(Mode(f"ours speculative sample (gamma={g})", ours("sample", gamma=g, **sk), "ours sample"))
        modes.append(Mode("ours greedy", ours("sample", gamma=0, **gk)))
        modes.append(Mode(f"ours speculative greedy (gamma={g})", ours("sample", gamma=g, **gk), "ours greedy"))
        if args.draft_confidence:
            gm, conf = args.max_gamma, args.draft_confidence
            modes.append(Mode(f"ours speculative sample (gamma<={gm}, conf {conf:g})", ours(
                "sample", gamma=gm, draft_confidence=conf, **sk), "ours sample"))
            modes.append(Mode(f"ours speculative greedy (gamma<={gm}, conf {conf:g})", ours(
                "sample", gamma=gm, draft_confidence=conf, **gk), "ours greedy"))
        if args.draft_cond_scale and args.cond_scale > 1:  # the same rows with a gentler-guided draft
            ds = args.draft_cond_scale
            modes.append(Mode(f"ours speculative sample (gamma={g}, draft cfg {ds:g})", ours(
                "sample", gamma=g, draft_cond_scale=ds, **sk), "ours sample"))
            if args.draft_confidence:
                modes.append(Mode(f"ours speculative sample (gamma<={gm}, conf {conf:g}, draft cfg {ds:g})", ours(
                    "sample", gamma=gm, draft_confidence=conf, draft_cond_scale=ds, **sk), "ours sample"))
    if not (args.skip_upstream_beam or args.skip_upstream):
        modes.append(Mode(f"spear-tts generate (beam {k})", upstream(beam_search_decode=True, beam_size=k)))
    upstream_beam = None if args.skip_upstream_beam or args.skip_upstream else f"spear-tts generate (beam {k})"
    modes.append(Mode(f"ours beam search (beam {k})", ours("beam_search", beam_size=k, gamma=0), upstream_beam))
    if has_exit and _has_spec_beam():
        widths = [w or default_draft_width(k) for w in args.draft_width]
        for bg in args.beam_gamma:
            for w in widths:
                modes.append(Mode(f"ours speculative beam (beam {k}, gamma={bg}, W={w})",
                                  ours("beam_search", beam_size=k, gamma=bg, draft_width=w), f"ours beam search (beam {k})"))
        dropin = _dropin(model, args.compile)  # --compile: the drop-in's compiled path too
        if dropin is not None and upstream_beam:
            bg, w = args.beam_gamma[0], widths[0]  # the first setting: the fastest on our CPU runs

            def run_dropin(**kw: object) -> Callable[[], tuple[int, None]]:
                def run() -> tuple[int, None]:  # spear-tts's beam semantics (the drop-in's default)
                    outs = [dropin(src, source_type="text", target_type="speech", max_length=n, beam_search_decode=True,
                                   beam_size=k, progress=False, **kw) for src, n in inputs]
                    return sum(kept_tokens(out) for out in outs), None
                return run
            modes.append(Mode(f"drop-in generate(beam {k})", run_dropin(), f"spear-tts generate (beam {k})"))
            modes.append(Mode(f"drop-in generate(beam {k}, spec, gamma={bg}, W={w})", run_dropin(
                spec_decode=True, spec_decode_gamma=bg, draft_width=w), f"spear-tts generate (beam {k})"))
    if has_exit and not args.skip_auto:  # gamma="auto", right after its baseline (compared with the best
        # fixed setting of its family in `report`)
        for auto_mode in (Mode("ours auto sample (gamma=auto)", ours("sample", gamma="auto", **sk), "ours sample"),
                          Mode("ours auto greedy (gamma=auto)", ours("sample", gamma="auto", **gk), "ours greedy"),
                          Mode(f"ours auto beam (beam {k}, gamma=auto)", ours("beam_search", beam_size=k, gamma="auto"),
                               f"ours beam search (beam {k})")):
            at = next(i for i, m in enumerate(modes) if m.name == auto_mode.baseline)
            modes.insert(at + 1, auto_mode)
    return modes


FAMILIES = ("sample", "greedy", "beam")


def family(mode: str) -> str:
    """The family of a row (its plain mode's): beam search, greedy decoding or sampling."""
    return "beam" if "beam" in mode else "greedy" if "greedy" in mode else "sample"


def _has_spec_beam() -> bool:
    try:
        import tts_specdec.spec_beam  # noqa: F401
    except ImportError:
        return False
    return True


def _dropin(model: TextToSemantic, compile: bool | str = False) -> Callable | None:
    try:
        from tts_specdec import generate
    except ImportError:
        return None
    return lambda source, **kw: generate(model, source, compile=compile, **kw)


def measure(modes: list[Mode], reps: int) -> None:
    for mode in modes:  # warm-up: first-call allocations and lazy init stay out of the numbers
        start = time.perf_counter()
        mode.run()
        mode.warmup_s = time.perf_counter() - start
        print(f"  warm-up {mode.name}: {mode.warmup_s:.1f} s", file=sys.stderr)
    for rep in range(reps):
        for mode in modes:
            start = time.perf_counter()
            tokens, stats = mode.run()
            mode.times.append(time.perf_counter() - start)
            mode.tokens.append(tokens)
            mode.stats = stats if stats is not None else mode.stats
        print(f"  repetition {rep + 1}/{reps} done", file=sys.stderr)


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it; `compute` leaves out views, which launch nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.compute = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops += 1
        self.compute += not (func.is_view or func is torch.ops.aten._unsafe_view.default)
        return func(*args, **(kwargs or {}))


def count_ops(modes: list[Mode], reps: int) -> list[dict]:
    """Each mode `reps` times on torch's path (after a warm-up run that prepares weights): ops per
    generated token over all reps, and the ratio of its baseline's count to its own."""
    from tts_specdec import kernels

    kernels.ENABLED = False  # read when a decode call prepares its weights
    rows = {}
    for mode in modes:
        mode.run()
        tokens, passes = 0, 0
        with _OpCounter() as counter:
            for _ in range(reps):
                n, stats = mode.run()
                tokens += n
                passes += stats.target_passes if stats is not None and stats.gamma else 0
        rows[mode.name] = row = {"mode": mode.name, "tokens": tokens, "ops_per_token": counter.ops / tokens,
                                 "compute_ops_per_token": counter.compute / tokens}
        if passes:
            row["tokens_per_target_pass"] = tokens / passes
        base = rows.get(mode.baseline) if mode.baseline else None
        if base is not None:
            row["vs"] = mode.baseline
            row["ops_ratio"] = base["ops_per_token"] / row["ops_per_token"]
            row["compute_ops_ratio"] = base["compute_ops_per_token"] / row["compute_ops_per_token"]
        print(f"  counted {mode.name}", file=sys.stderr)
    return list(rows.values())


def print_counts(result: dict) -> None:
    print(f"\n{result['setup']}\ntorch ops per generated token on torch's path (CPU kernels off); "
          "ratio = the baseline's count / the mode's")
    print(f"\n{'mode':48s} {'ops/tok':>8s} {'compute':>8s} {'ratio':>22s} {'tok/pass':>8s}")
    for r in result["rows"]:
        ratio = f"{r['ops_ratio']:.2f}x ({r['compute_ops_ratio']:.2f}x) vs {r['vs'][:6]}" if "vs" in r else ""
        per_pass = f"{r['tokens_per_target_pass']:.2f}" if "tokens_per_target_pass" in r else ""
        print(f"{r['mode']:48s} {r['ops_per_token']:8.0f} {r['compute_ops_per_token']:8.0f} {ratio:>22s} {per_pass:>8s}")


def _plain_step(modes: list[Mode]) -> float | None:
    """Seconds per plain target step (our greedy: one step per token, every layer), this run's own stats."""
    plain = next((m for m in modes if m.name == "ours greedy"), None)
    if not plain or not plain.stats or not plain.stats.steps:
        return None
    return plain.stats.wall_time / plain.stats.steps


def cost_ratio(modes: list[Mode], target_step: float | None) -> float | None:
    """c = time of one draft step / `target_step` (`_plain_step`), from this run's own stats."""
    spec = next((m for m in modes if m.name.startswith("ours speculative greedy")), None)
    if target_step is None or not spec or not spec.stats or not spec.stats.draft_passes:
        return None
    return spec.stats.draft_time / spec.stats.draft_passes / target_step


def verify_ratio(stats: DecodeStats, target_step: float | None) -> float | None:
    """v = time of one verify pass (layers E+1..L on the drafted positions, target head, accept rule) /
    time of one plain target step. Leviathan et al.'s bound takes v = 1: verifying gamma + 1 tokens costs
    one step, true where a step is bound by reading weights or launching kernels, not by arithmetic."""
    if target_step is None or not stats.target_passes:
        return None
    return stats.verify_time / stats.target_passes / target_step


def leviathan_bound(alpha: float, gamma: int, c: float, v: float = 1.0) -> float:
    """Expected walltime improvement (Leviathan et al. 2022, Theorem 3.8) for a draft step costing c
    target steps; v != 1 generalises it to a verify pass costing v target steps (their v = 1)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    tokens = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens / (gamma * c + v)


def machine_info(device: str) -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu, "device": device}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
    else:
        from tts_specdec import kernels

        reason = kernels.unavailable_reason()
        info["small_product_kernel"] = reason or "on"
        if not reason:  # which tiles ran: the same "AMD EPYC" may be a Zen 3 (AVX2) or Zen 4
            info["isa"] = kernels.isa()
    return info


def step_weight_bytes(model: TextToSemantic) -> int:
    """Bytes of weights one plain target step reads: every decoder layer's products (the cross-attention
    K/V projections excluded: they run once per source) and the output head."""
    tt = model.target_transformer
    skip = {id(cross.to_kv[0].weight) for _, cross, _ in tt.layers}
    layers = sum(p.numel() * p.element_size() for p in tt.layers.parameters() if id(p) not in skip)
    head = model.to_logits["speech"].weight
    return layers + head.numel() * head.element_size()


def report(setup: Setup, modes: list[Mode], args: argparse.Namespace) -> dict:
    by_name = {m.name: m for m in modes}
    target_step = _plain_step(modes)
    c = cost_ratio(modes, target_step)
    weight_gbs = step_weight_bytes(setup.model) / target_step / 1e9 if target_step else None
    beam = next((m for m in modes if m.name.startswith("ours beam search")), None)
    beam_step = beam.stats.wall_time / beam.stats.steps if beam and beam.stats and beam.stats.steps else None
    rows = []
    for m in modes:
        row = {"mode": m.name, "tokens_per_s": m.tokens_per_s, "median_s": statistics.median(m.times),
               "tokens": statistics.median(m.tokens), "warmup_s": m.warmup_s}
        if m.baseline and m.baseline in by_name:
            row["vs"] = m.baseline
            row["speedup"] = m.tokens_per_s / by_name[m.baseline].tokens_per_s
        s = m.stats
        if s is not None and getattr(s, "gamma_hist", None):
            row["gamma_hist"] = s.gamma_hist
        if s is not None and s.gamma:
            if s.accepted_hist:
                row.update(alpha=s.alpha, tokens_per_target_pass=s.tokens_per_target_pass,
                           accepted_hist=s.accepted_hist)
                v = verify_ratio(s, target_step)
                if v is not None:
                    row["verify_cost_v"] = v
                if c is not None and s.draft_confidence is None:  # the bounds assume a fixed gamma
                    row["leviathan_bound"] = leviathan_bound(s.alpha, s.gamma, c)
                    if v is not None:  # with this machine's verify cost; at alpha = 1: no draft can beat it
                        row["bound_at_v"] = leviathan_bound(s.alpha, s.gamma, c, v)
                        row["ceiling_alpha1_at_v"] = leviathan_bound(1.0, s.gamma, c, v)
                        if "speedup" in row:
                            row["fraction_of_bound_at_v"] = row["speedup"] / row["bound_at_v"]
            if s.committed_hist:
                row.update(steps_per_target_pass=s.steps_per_target_pass, committed_hist=s.committed_hist)
        rows.append(row)
    for row in rows:  # auto against the best fixed setting of its family (plain decoding included: 1.0)
        if row["mode"].startswith("ours auto") and "speedup" in row:
            fixed = [r["speedup"] for r in rows if r.get("vs") == row["vs"] and not r["mode"].startswith("ours auto")]
            row["vs_best_fixed"] = row["speedup"] / max(fixed + [1.0])
    return {"machine": machine_info(args.device), "setup": setup.description, "batch": int(setup.sources[0].shape[0]),
            "sentences": len(setup.sources), "max_length": max(setup.max_lengths), "reps": args.reps,
            "compile": args.compile, "gamma": args.gamma, "top_k": args.top_k or None, "top_p": args.top_p or None, "cond_scale": args.cond_scale,
            "cost_ratio_c": c, "plain_step_s": target_step, "plain_weight_read_GBps": weight_gbs,
            "beam_step_over_greedy_step": beam_step / target_step if beam_step and target_step else None,
            "rows": rows}


def print_table(result: dict) -> None:
    m = result["machine"]
    print(f"\n{result['setup']}")
    print(f"torch {m['torch']}, {m['threads']} threads, {m.get('gpu') or m['cpu']}, batch {result['batch']}, "
          f"median of {result['reps']} interleaved reps"
          + (f", small-product kernel: {m['small_product_kernel']}" if "small_product_kernel" in m else ""))
    if result.get("top_k") or result.get("top_p") or result.get("cond_scale", 1.0) != 1.0:
        print(f"sampling and greedy rows: top_k {result.get('top_k')}, top_p {result.get('top_p')}, "
              f"cond_scale {result.get('cond_scale')}")
    if result.get("plain_weight_read_GBps"):
        print(f"plain target step {1e3 * result['plain_step_s']:.2f} ms: weights read at "
              f"{result['plain_weight_read_GBps']:.1f} GB/s")
    if result.get("beam_step_over_greedy_step"):
        print(f"a beam step costs {result['beam_step_over_greedy_step']:.2f} greedy steps")
    if result["cost_ratio_c"] is not None:
        print(f"measured draft/target step cost ratio c = {result['cost_ratio_c']:.3f}")
        print("bound: Leviathan et al.'s (a verify pass costs one target step); v: a verify pass's measured cost "
              "in target steps; at v: the bound with that cost; a=1 at v: the same with every draft accepted")
    print(f"\n{'mode':48s} {'tok/s':>9s} {'speedup':>20s} {'alpha':>6s} {'tok/pass':>8s} {'bound':>6s} {'v':>5s} "
          f"{'at v':>5s} {'a=1 at v':>8s} {'of at v':>7s}")

    def num(r: dict, key: str, width: int) -> str:
        return f"{r[key]:{width}.2f}" if key in r else " " * width

    for r in result["rows"]:
        speed = f"{r['speedup']:.2f}x vs {r['vs'][:11]}" if "speedup" in r else ""
        alpha = f"{r['alpha']:.3f}" if "alpha" in r else ""
        per_pass = r.get("tokens_per_target_pass", r.get("steps_per_target_pass"))
        per_pass = f"{per_pass:.2f}" if per_pass is not None else ""
        print(f"{r['mode']:48s} {r['tokens_per_s']:9.1f} {speed:>20s} {alpha:>6s} {per_pass:>8s} "
              f"{num(r, 'leviathan_bound', 6)} {num(r, 'verify_cost_v', 5)} {num(r, 'bound_at_v', 5)} "
              f"{num(r, 'ceiling_alpha1_at_v', 8)} {num(r, 'fraction_of_bound_at_v', 7)}")
        if "vs_best_fixed" in r:
            print(f"{'':48s}   {r['vs_best_fixed']:.3f} of the best fixed setting; gammas used: {r.get('gamma_hist')}")
        for key in ("accepted_hist", "committed_hist"):
            if key in r:
                print(f"{'':48s}   {key}: {r[key]}")


def main(argv: list[str] | None = None) -> dict:
    p = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["reference", "default"], default="reference")
    p.add_argument("--checkpoint", type=Path, help="with --model default: a speech checkpoint directory")
    p.add_argument("--widen", type=int, nargs="+", metavar="N",
                   help="with --model default: DIM HEADS [DEPTH]: the checkpoint widened function-preservingly "
                        "(tts_specdec.widen), a realistic size with the same outputs")
    p.add_argument("--batch", type=int, default=1,
                   help="with --model default: sentences per batch (without --sentences: 1-4 fixed sentences)")
    p.add_argument("--sentences", type=int, default=1,
                   help="with --model default: decode this many held-out corpus sentences one at a time (batch 1)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--gamma", type=cli.int_in(0, MAX_FIXED_GAMMA), default=4)
    p.add_argument("--draft-confidence", type=float, default=0.9,
                   help="rows with early draft stops: a row stops drafting below this draft probability (0: no rows)")
    p.add_argument("--max-gamma", type=cli.int_in(1, MAX_FIXED_GAMMA), default=10, help="most drafts per cycle in the early-stop rows")
    p.add_argument("--beam-size", type=cli.int_in(1, MAX_BEAM_SIZE), default=4)
    p.add_argument("--beam-gamma", type=cli.int_in(1, MAX_FIXED_GAMMA), nargs="+", default=[1, 3],
                   help="draft levels per cycle of speculative beam search (a row per value and width)")
    p.add_argument("--draft-width", type=cli.int_at_least(0), nargs="+", default=[8, 12],
                   help="draft beam widths W (>= beam size; 0: the library's default, beam size + ceil(beam size / 4))")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0,
                   help="sampling rows keep the k most likely tokens, ours and spear-tts's (0: ours unfiltered, "
                        "spear-tts its default top 10%%)")
    p.add_argument("--top-p", type=float, default=0.0,
                   help="sampling rows keep the smallest set of tokens holding this mass, ours and spear-tts's "
                        "(0: none; needs --temperature 1, where both filters agree)")
    p.add_argument("--cond-scale", type=float, default=1.0,
                   help="classifier-free guidance scale of the sampling and greedy rows (beam rows: 1)")
    p.add_argument("--draft-cond-scale", type=float, default=0.0,
                   help="with --cond-scale > 1: extra speculative sampling rows whose draft is guided at this scale")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--distill-steps", type=int, default=300, help="reference model: exit-head distillation steps")
    p.add_argument("--skip-upstream-beam", action="store_true", help="skip spear-tts beam search (slowest row)")
    p.add_argument("--skip-upstream", action="store_true", help="skip every spear-tts row (large models)")
    p.add_argument("--skip-auto", action="store_true", help="skip the gamma='auto' rows")
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES),
                   help="run only these families of rows (plain, speculative and auto rows of each; "
                        "without greedy the plain step, c and v are not measured)")
    p.add_argument("--count-ops", action="store_true",
                   help="count torch ops per token on torch's path instead of timing (see above)")
    p.add_argument("--compile", nargs="?", const=True, default=False, metavar="BACKEND",
                   help="our rows on static steps under torch.compile (SpeculativeDecoder(compile=...)): inductor, "
                        "CUDA graphs on a GPU; or the named torch.compile backend. Compilation happens in the warm-up")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="convert the model (model.to(dtype)) before decoding; on the CPU half precision decodes "
                        "in float32 on its widened weights (docs/design.md)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.top_k < 0 or args.cond_scale < 1 or not 0 <= args.top_p < 1:
        p.error("--top-k must be >= 0, --top-p in [0, 1), --cond-scale >= 1")
    if args.top_p and (args.top_k or args.temperature != 1):
        p.error("--top-p goes alone with --temperature 1 (spear-tts filters before the temperature)")
    torch.set_num_threads(args.threads)
    if args.sentences > 1 and args.model != "default":
        p.error("--sentences > 1 needs --model default")
    if args.batch < 1:
        p.error("--batch must be >= 1")
    if args.widen and (args.model != "default" or len(args.widen) not in (2, 3)):
        p.error("--widen takes DIM HEADS [DEPTH] and needs --model default")
    try:
        setup = (reference_model(args.seed, args.device, args.distill_steps) if args.model == "reference"
                 else default_model(args.device, args.checkpoint, args.batch, args.sentences, args.widen))
    except ValueError as e:
        p.error(str(e))
    if args.dtype != "float32":  # the model as a user converts it; its rows decode it in that dtype
        setup.model.to(getattr(torch, args.dtype))
        setup.description += f", model in {args.dtype}"
    modes = [m for m in build_modes(setup, args) if family(m.name) in args.families]
    if args.count_ops:
        rows = count_ops(modes, args.reps)
        machine = machine_info(args.device)
        if "small_product_kernel" in machine:  # count_ops switched the kernels off, not the environment
            machine["small_product_kernel"] = "off for --count-ops (torch's path is what is counted)"
        result = {"machine": machine, "setup": setup.description, "gamma": args.gamma,
                  "counted": "torch ops per generated token, torch's path", "rows": rows}
        print_counts(result)
    else:
        measure(modes, args.reps)
        result = report(setup, modes, args)
        if args.compile:  # graphs compiled and recompilations over the whole run (warm-ups included)
            from torch._dynamo.utils import counters

            result["torch_compile"] = {k: dict(counters[k]) for k in ("stats", "recompiles", "graph_break")}
        print_table(result)
    if args.json:
        write_json(args.json, result, indent=2)
        print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()
