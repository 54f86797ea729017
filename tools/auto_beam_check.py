"""Plain beam search against beam search with gamma="auto" on the shipped model, interleaved in one
process: the two should run at the same speed wherever auto keeps plain beam search (it returns the
same tokens either way; this checks that choosing costs nothing). Usage: python tools/auto_beam_check.py [REPS]"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from tts_specdec import SpeculativeDecoder
from tts_specdec.speech.checkpoint import load_checkpoint
from tts_specdec.speech.pipeline import ASSETS, default_max_length
from tts_specdec.speech.references import heldout_sentences


def main(reps: int = 7, sentences: int = 20, threads: int = 2) -> None:
    torch.set_num_threads(threads)
    model = load_checkpoint(ASSETS).model
    dec = SpeculativeDecoder(model)
    sources = [model.tokenizer_encode([t]) for t in heldout_sentences(sentences)]

    def run(gamma: int | str) -> tuple[float, int]:
        start, n = time.perf_counter(), 0
        for s in sources:
            out = dec.beam_search(s, beam_size=4, gamma=gamma, max_length=default_max_length(s))
            n += sum(x.numel() for x in out.tokens)
        return time.perf_counter() - start, n

    run(0), run("auto")  # warm-up: kernels, prepared weights, auto's cost model
    ratios = []
    for r in range(reps):
        plain, n_plain = run(0)
        auto, n_auto = run("auto")
        assert n_plain == n_auto, "auto beam search returned other tokens"
        ratios.append(plain / auto)
        print(f"rep {r}: plain {n_plain / plain:.1f} tok/s, auto {n_auto / auto:.1f} tok/s, auto/plain {plain / auto:.3f}",
              flush=True)
    print(f"median auto/plain {statistics.median(ratios):.3f} ({threads} threads, {sentences} sentences, {reps} reps)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
