"""Randomised equivalence sweep over tiny random models (a development tool, not part of CI).

Each case draws a model shape (width, heads, kv heads, depth, exit layer, vocabulary, EOS or not, weight
scale), a ragged batch of sources, max_length and guidance, then checks one of:
  greedy  speculative greedy (gamma 1-8 or "auto", optional draft stops and draft guidance) == plain greedy, and
          a row of the batch decoded alone == that row in the batch;
  beam    speculative beam search (gamma 1-3, draft width K..2K) == plain beam search (on the kernels
          the scores too, to the bit);
  sample  speculative sampling with filters: every row within max_length, no EOS or pad in the output,
          accepted <= drafted; with top_k = 1 it must equal greedy decoding.
Prints every failing case with what is needed to rebuild it. Run it on every path:

    python tools/fuzz_equivalence.py --seed 1 --seconds 300
    TTS_SPECDEC_KERNELS=0 python tools/fuzz_equivalence.py --seed 2 --seconds 300
    python tools/fuzz_equivalence.py --seed 3 --seconds 300 --compile aot_eager
    python tools/fuzz_equivalence.py --seed 5 --seconds 300 --compile none --record-runs
    python tools/fuzz_equivalence.py --seed 4 --seconds 300 --dtype bfloat16   # also with TTS_SPECDEC_KERNELS=0
    python tools/fuzz_equivalence.py --seed 6 --seconds 300 --dtype bfloat16 --native

--compile B decodes with `SpeculativeDecoder(model, compile=B)` (static compiled steps) and takes the plain
references (greedy, beam) from the default path, in float64 so that the two paths' arithmetic (~1e-15 apart)
cannot flip a token; every case compiles its own graphs (seconds each).
--compile none runs the static path's step functions uncompiled (its loops and bookkeeping, many cases).
--record-runs runs what a GPU records (runs of plain steps, runs of up to 4 speculative cycles) unrecorded.
--dtype bfloat16 converts every model with `model.to(torch.bfloat16)` (on the kernels: bfloat16 panels).
--native computes in the models' own dtype on torch's path, as on a GPU (TTS_SPECDEC_HALF=native; on the
CPU a half-precision model otherwise computes in float32), in fixed tiles as every dtype there
(`tts_specdec.tiles`). Its check that top_k=1 sampling equals greedy decoding is skipped: bfloat16 logits
tie exactly now and then, and top-k keeps every token tied with the k-th.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import make_model, make_source, uncompiled_graph  # noqa: E402
from tts_specdec import SpeculativeDecoder  # noqa: E402
from tts_specdec.tiles import HALF  # noqa: E402
from tts_specdec.backends import StaticCompiled  # noqa: E402


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def model_config(rng: random.Random) -> dict:
    depth = rng.randint(2, 6)
    return dict(dim=rng.choice([16, 32, 48]), heads=rng.choice([1, 2, 4]), dim_head=rng.choice([8, 16, 24]),
                kv_heads=rng.choice([None, 1]), target_depth=depth, exit_layer=rng.randint(1, depth),
                eos=rng.random() < 0.8, semantic_vocab=rng.choice([5, 12, 40]), std=rng.choice([0.3, 0.5, 1.0]),
                source_depth=rng.randint(1, 2), cond_drop_prob=0.1)


def greedy_case(rng: random.Random, dec: SpeculativeDecoder, ref: SpeculativeDecoder, src: torch.Tensor,
                lengths: list[int], ml: int, cs: float) -> tuple[bool, str]:
    gamma, conf = rng.choice([1, 2, 3, 4, 5, 6, 7, 8, "auto"]), rng.choice([None, None, 0.3, 0.9])
    draft_cs = rng.choice([None, 1.0, 2.0]) if cs > 1 else None
    plain = ref.sample(src, temperature=0, max_length=ml, cond_scale=cs, gamma=0).tokens
    spec = dec.sample(src, temperature=0, max_length=ml, cond_scale=cs, gamma=gamma, draft_confidence=conf,
                      draft_cond_scale=draft_cs).tokens
    what = f"greedy gamma={gamma} draft_confidence={conf} draft_cond_scale={draft_cs}"
    if not same(plain, spec):
        return False, what
    if len(lengths) > 1:
        r = rng.randrange(len(lengths))
        alone = dec.sample(src[r : r + 1, : lengths[r]], temperature=0, max_length=ml, cond_scale=cs, gamma=gamma,
                           draft_confidence=conf, draft_cond_scale=draft_cs).tokens
        if not torch.equal(alone[0], spec[r]):
            return False, f"{what}, row {r} alone"
    return True, what


def beam_case(rng: random.Random, dec: SpeculativeDecoder, ref: SpeculativeDecoder, src: torch.Tensor, ml: int,
              cs: float) -> tuple[bool, str]:
    k, gamma = rng.randint(1, 4), rng.randint(1, 3)
    width, lp = rng.randint(k, 2 * k), rng.choice([0.0, 1.0, 2.0])
    ml = min(ml, 20)
    plain = ref.beam_search(src, beam_size=k, length_penalty=lp, max_length=ml, cond_scale=cs, gamma=0)
    spec = dec.beam_search(src, beam_size=k, length_penalty=lp, max_length=ml, cond_scale=cs, gamma=gamma,
                           draft_width=width)
    what = f"beam K={k} gamma={gamma} W={width} length_penalty={lp} max_length={ml}"
    # a tree pass gives each node a beam step's bits (the kernels' attention and torch's tiles gather the
    # keys a node sees): the scores too, to the last bit, where plain and speculative run on one path
    exact_scores = dec is ref
    return same(plain.tokens, spec.tokens) and (not exact_scores or plain.scores == spec.scores), what


def sample_case(rng: random.Random, dec: SpeculativeDecoder, src: torch.Tensor, ml: int, cs: float,
                seed: int) -> tuple[bool, str]:
    gamma, conf = rng.randint(1, 8), rng.choice([None, 0.5])
    top_k, top_p, temp = rng.choice([None, 1, 3]), rng.choice([None, 0.5, 0.95]), rng.choice([0.5, 1.0, 2.0])
    what = f"sample gamma={gamma} draft_confidence={conf} top_k={top_k} top_p={top_p} temperature={temp}"
    out = dec.sample(src, temperature=temp, top_k=top_k, top_p=top_p, max_length=ml, cond_scale=cs, gamma=gamma,
                     draft_confidence=conf, generator=torch.Generator().manual_seed(seed))
    eos, pad = dec.decoder.eos_id, dec.model.semantic_pad_id
    ok = len(out.tokens) == src.shape[0] and out.stats.accepted <= out.stats.drafted and all(
        t.numel() <= ml and (t >= 0).all() and not (t == pad).any() and (eos is None or not (t == eos).any())
        for t in out.tokens)
    if ok and top_k == 1 and dec.decoder.dtype not in HALF:  # one candidate left: sampling is greedy decoding
        # (half precision: logits tie exactly now and then, and top-k keeps every token tied with the k-th)
        ok = same(dec.sample(src, temperature=0, max_length=ml, cond_scale=cs, gamma=0).tokens, out.tokens)
    return ok, what


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--compile", default=None, help="a torch.compile backend (aot_eager, inductor): decode "
                   "compiled; none: the static path uncompiled")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the models' dtype (not with --compile)")
    p.add_argument("--native", action="store_true",
                   help="with --dtype bfloat16: compute in bfloat16 on torch's path (tiles), as on a GPU")
    p.add_argument("--record-runs", action="store_true",
                   help="with --compile: decode as where runs are recorded (on a GPU), here unrecorded: plain runs and "
                        "runs of speculative cycles on their own buffers and random numbers")
    args = p.parse_args()
    if args.compile and args.dtype != "float32":
        p.error("--dtype: the compiled path is checked in float64 against the default path")
    if args.native and (args.compile or args.dtype == "float32"):
        p.error("--native: with --dtype bfloat16, without --compile")
    if args.native:  # as TTS_SPECDEC_HALF=native
        import tts_specdec.weights as weights

        weights.NATIVE_HALF = True
    if args.record_runs and not args.compile:
        p.error("--record-runs: only with --compile")
    if args.record_runs:
        StaticCompiled.records = lambda self, device: True
    if args.compile == "none":  # the static path's step functions as plain Python: many more cases a minute
        StaticCompiled._graph = uncompiled_graph
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    end, cases, failures = time.time() + args.seconds, 0, 0
    while time.time() < end:
        cases += 1
        cfg, seed = model_config(rng), rng.randint(0, 10**6)
        batch, width = rng.randint(1, 5), rng.randint(1, 9)
        lengths = [rng.randint(1, width) for _ in range(batch)]
        src = make_source(batch, width, seed=seed, lengths=lengths)
        ml, cs = rng.randint(1, 40), rng.choice([1.0, 1.0, 3.0])
        case = f"model {cfg} seed {seed}, source lengths {lengths}, max_length {ml}, cond_scale {cs}"
        try:
            if args.compile:
                model = make_model(seed, dtype=torch.float64, **cfg)
                backend = "aot_eager" if args.compile == "none" else args.compile  # none: `_graph` never compiles
                dec, ref = SpeculativeDecoder(model, compile=backend), SpeculativeDecoder(model)
            else:
                dec = ref = SpeculativeDecoder(make_model(seed, **cfg).to(getattr(torch, args.dtype)))
            kind = rng.choice(["greedy", "greedy", "beam", "sample"])
            if kind == "greedy":
                ok, what = greedy_case(rng, dec, ref, src, lengths, ml, cs)
            elif kind == "beam":
                ok, what = beam_case(rng, dec, ref, src, ml, cs)
            else:
                ok, what = sample_case(rng, dec, src, ml, cs, seed)
            if not ok:
                failures += 1
                print(f"MISMATCH {what}; {case}", flush=True)
        except Exception:
            failures += 1
            print(f"ERROR {case}", flush=True)
            traceback.print_exc(limit=4)
    print(f"{cases} cases, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
