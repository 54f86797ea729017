"""Plain beam search against beam search with gamma="auto", interleaved in one process: the two should
run at the same speed wherever auto keeps plain beam search (it returns the same tokens either way;
this checks that choosing costs nothing). The shipped model, or it widened function-preservingly.

    python tools/auto_beam_check.py [--reps 7] [--sentences 20] [--widen 1024 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tts_specdec import SpeculativeDecoder
from tts_specdec.speech.checkpoint import load_checkpoint
from tts_specdec.speech.pipeline import ASSETS, default_max_length
from tts_specdec.speech.references import heldout_sentences
from tts_specdec.widen import widen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--sentences", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--widen", type=int, nargs="+", metavar="N", help="DIM HEADS [DEPTH] (tts_specdec.widen)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(ASSETS)
    if args.widen:
        ckpt = widen(ckpt, *args.widen)
    model = ckpt.model.eval()
    dec = SpeculativeDecoder(model)
    sources = [model.tokenizer_encode([t]) for t in heldout_sentences(args.sentences)]

    def run(gamma: int | str) -> tuple[float, int, list[int]]:
        start, n, hist = time.perf_counter(), 0, []
        for s in sources:
            out = dec.beam_search(s, beam_size=4, gamma=gamma, max_length=default_max_length(s))
            n += sum(x.numel() for x in out.tokens)
            hist = [a + b for a, b in zip(hist, out.stats.gamma_hist)] + out.stats.gamma_hist[len(hist):]
        return time.perf_counter() - start, n, hist

    run(0), run("auto")  # warm-up: kernels, prepared weights, auto's cost model
    ratios = []
    for r in range(args.reps):
        plain, n_plain, _ = run(0)
        auto, n_auto, hist = run("auto")
        assert n_plain == n_auto, "auto beam search returned other tokens"
        ratios.append(plain / auto)
        print(f"rep {r}: plain {n_plain / plain:.1f} tok/s, auto {n_auto / auto:.1f} tok/s, auto/plain {plain / auto:.3f}, "
              f"auto's steps and cycles by gamma {hist}", flush=True)
    size = f"widened to {args.widen}" if args.widen else "shipped model"
    print(f"median auto/plain {statistics.median(ratios):.3f} ({size}, {args.threads} threads, {args.sentences} sentences, "
          f"{args.reps} reps)")


if __name__ == "__main__":
    main()
