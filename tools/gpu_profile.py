"""Where a compiled decode spends its time on a GPU: per mode, tokens/s and a torch.profiler table.

For each mode (plain sampling, speculative sampling, beam search, speculative beam search; batch 1, the
shipped model unless --widen), on `SpeculativeDecoder(model, compile=True)`: compile and warm up, time
--reps decodes of one sentence, then profile one more. Prints per mode the tokens/s, the wall time and the
GPU's busy time per generated token (busy << wall: the host or a read-back is the bound; busy ~ wall: the
device is), the kernels launched per token by class (GEMMs, split-K reductions, fused Triton kernels, copies:
where a speculative cycle's device time goes against a plain step's), and the ops that take the most device
and host time. With --out DIR the profiler tables and a JSON of the figures are written there.

    python tools/gpu_profile.py --modes sample spec_sample beam spec_beam --profile --out /tmp/prof
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tts_specdec import SpeculativeDecoder, speculative  # noqa: E402
from tts_specdec.speech import load_default  # noqa: E402
from tts_specdec.speech.atomic import write_json, write_text  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog near the river bank."
MODES = {
    "sample": lambda d, g, t: d.sample([t], temperature=1.0, gamma=0, max_length=424, generator=g),
    "spec_sample": lambda d, g, t: d.sample([t], temperature=1.0, gamma=4, max_length=424, generator=g),
    "greedy": lambda d, g, t: d.sample([t], temperature=0.0, gamma=0, max_length=424),
    "spec_greedy": lambda d, g, t: d.sample([t], temperature=0.0, gamma=4, max_length=424),
    "beam": lambda d, g, t: d.beam_search([t], beam_size=4, gamma=0, max_length=424),
    "spec_beam": lambda d, g, t: d.beam_search([t], beam_size=4, gamma=1, draft_width=8, max_length=424),
}


def _cycles_per_run(mode, cycles: int):
    """`mode` with `cycles` speculative cycles per recorded run (TTS_SPECDEC_RECORD_RUNS=1 runs up to
    `speculative.CYCLES_PER_RUN`, 1 by default): 1 keeps the read-back per cycle that runs of cycles remove."""
    def run(d, g, t):
        saved, speculative.CYCLES_PER_RUN = speculative.CYCLES_PER_RUN, cycles
        try:
            return mode(d, g, t)
        finally:
            speculative.CYCLES_PER_RUN = saved
    return run


def _sampling(gamma: int | str, temperature: float = 1.0):
    """A mode that samples the sentence at `gamma` (greedy at temperature 0)."""
    return lambda d, g, t: d.sample([t], temperature=temperature, gamma=gamma, max_length=424, generator=g)


# gamma's other settings: with products as reduction kernels a verify pass costs about a step (docs/gpu.md),
# which moves the best gamma; auto picks its own from what it measures
MODES.update({f"spec_sample_g{gamma}": _sampling(gamma) for gamma in (2, 6, 8)})
MODES["spec_sample_auto"] = _sampling("auto")
MODES["spec_greedy_auto"] = _sampling("auto", temperature=0.0)
MODES["spec_sample_1cycle"] = _cycles_per_run(MODES["spec_sample"], 1)
MODES["spec_sample_4cycles"] = _cycles_per_run(MODES["spec_sample"], 4)
MODES["spec_sample_8cycles"] = _cycles_per_run(MODES["spec_sample"], 8)


# the deterministic modes whose speculative decode must give its plain decode's tokens
SAME = (("spec_greedy", "greedy"), ("spec_greedy_auto", "greedy"), ("spec_beam", "beam"))


def tokens_of(out) -> int:
    return int(out.stats.generated_tokens)


def texts_for(sentences: int) -> list[str]:
    """The one fixed sentence, or that many held-out corpus sentences (decoded one at a time)."""
    if sentences <= 1:
        return [TEXT]
    from tts_specdec.speech.references import heldout_sentences

    return list(heldout_sentences(sentences))


# a kernel's class by its name: what a mode's device time is made of, comparable between modes per token
# (first match wins: cuBLAS's split-K reductions, then GEMMs, inductor's Triton GEMM templates `triton_tem_`
# among them, then its other Triton kernels)
KERNEL_CLASSES = (("split-K reduce", ("splitkreduce",)), ("gemm", ("gemm", "gemv", "xmma", "cutlass", "triton_tem_")),
                  ("fused (triton)", ("triton_",)), ("copy/set", ("memcpy", "memset")))


def kernel_classes(events, tokens: int) -> dict[str, dict[str, float]]:
    """Per generated token, by class (`KERNEL_CLASSES`, else "other"): kernel launches and device
    microseconds, from a profile's key averages (events with device time of their own; a compiled graph's
    own event, which spans its kernels, is left out)."""
    out: dict[str, dict[str, float]] = {}
    for e in events:
        if e.key.startswith("## Call") or e.self_device_time_total <= 0:
            continue
        name = e.key.lower()
        kind = next((k for k, marks in KERNEL_CLASSES if any(m in name for m in marks)), "other")
        entry = out.setdefault(kind, {"launches": 0.0, "device_us": 0.0})
        entry["launches"] += e.count / tokens
        entry["device_us"] += e.self_device_time_total / tokens
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--sentences", type=int, default=1,
                   help="decode this many held-out sentences one at a time per repetition (1: the fixed sentence)")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of this script (no device times)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: a quick dry run)")
    p.add_argument("--profile", action="store_true", help="also profile one decode per mode")
    p.add_argument("--rows", type=int, default=20, help="ops listed per table")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = load_default().model.to(args.device).eval()
    dec = SpeculativeDecoder(model, compile=True if args.backend == "inductor" else args.backend)
    report = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__, "modes": {}}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    texts = texts_for(args.sentences)
    report["sentences"] = len(texts)
    outputs: dict[str, list] = {}  # each mode's tokens of its first repetition: a speculative mode against its plain one
    for name in args.modes:
        mode = MODES[name]
        g = torch.Generator(device=args.device)
        t0 = time.perf_counter()
        g.manual_seed(0)
        mode(dec, g, texts[0])  # the first call of the shape: compiles
        sync()
        warm = time.perf_counter() - t0
        for text in texts:  # a second call of each shape: CUDA graphs are recorded on the first replays
            g.manual_seed(0)
            mode(dec, g, text)
        sync()
        seconds, tokens, accepted, judged = 0.0, 0, 0, 0
        for rep in range(args.reps):
            for i, text in enumerate(texts):
                g.manual_seed(rep * len(texts) + i)
                sync()
                t = time.perf_counter()
                out = mode(dec, g, text)
                sync()
                seconds += time.perf_counter() - t
                if rep == 0:
                    outputs.setdefault(name, []).append([row.tolist() for row in out.tokens])
                tokens += tokens_of(out)
                accepted += out.stats.accepted
                judged += out.stats.accepted + out.stats.rejections
        fig = {"first_call_s": warm, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
        if judged:
            fig["alpha"] = accepted / judged  # the acceptance over every timed decode
        report["modes"][name] = fig
        print(f"\n== {name}: {fig['tokens_per_s']:.1f} tokens/s ({tokens} tokens in {args.reps * len(texts)} decodes, first call "
              f"{warm:.1f} s{', alpha %.2f' % fig['alpha'] if judged else ''})", flush=True)
        if args.out:  # after every mode: a run stopped at its time limit keeps what it measured
            write_json(args.out / "profile.json", report, indent=2)
    same = {f"{spec} == {plain}": outputs[spec] == outputs[plain] for spec, plain in SAME if spec in outputs and plain in outputs}
    if same:
        report["same_tokens"] = same
        print("\nsame tokens: " + ", ".join(f"{k} {v}" for k, v in same.items()), flush=True)
        if args.out:
            write_json(args.out / "profile.json", report, indent=2)
    # profiled after every mode is timed: on an H200 (2026-11-29) modes timed after a profiled decode ran
    # 20-30% slower than the same modes in a process that profiled nothing
    for name in args.modes if args.profile else ():
        fig, mode = report["modes"][name], MODES[name]
        g = torch.Generator(device=args.device)
        g.manual_seed(0)
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            sync()
            t = time.perf_counter()
            out = mode(dec, g, texts[0])
            sync()
            wall = time.perf_counter() - t
        n = tokens_of(out)
        events = prof.key_averages()
        # kernels and copies only (a compiled graph's own event spans its kernels: not counted twice)
        classes = kernel_classes(events, n)
        fig.update(profiled_tokens=n, profiled_wall_ms_per_token=1e3 * wall / n,
                   device_ms_per_token=sum(c["device_us"] for c in classes.values()) / 1e3, kernels_per_token=classes)
        print(f"\n== {name}, profiled (the profiler slows the host): wall {fig['profiled_wall_ms_per_token']:.3f} ms/token, "
              f"kernels {fig['device_ms_per_token']:.3f} ms/token", flush=True)
        print("kernels per token by class (launches, device us): " + ", ".join(
            f"{k} {v['launches']:.1f} / {v['device_us']:.1f}" for k, v in fig["kernels_per_token"].items()), flush=True)
        by_dev = events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=args.rows)
        by_cpu = events.table(sort_by="self_cpu_time_total", row_limit=args.rows)
        print(by_dev, flush=True)
        print(by_cpu, flush=True)
        if args.out:
            write_text(args.out / f"{name}.txt", by_dev + "\n" + by_cpu)
    if args.out:
        write_json(args.out / "profile.json", report, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
