"""Exactness on a given device: every speculative mode against its plain mode on the shipped checkpoint.

The unit tests run on CPU (CI has no GPU); this recipe repeats their central equivalences where the
decoder runs on another device (CUDA), on held-out sentences:

- greedy speculative sampling (gamma 1, 2, 4, 8, with and without draft stops) == greedy sampling;
- a batch of sentences decoded together == each decoded alone (greedy, plain and speculative);
- speculative beam search == beam search (tokens; scores to float tolerance);
- the same fixed-seed sampled tokens from the step-by-step torch path and the fused path (CPU only).

It also reports how often the device's greedy tokens equal the CPU's (not required: float sums are
ordered differently on each device, so near-ties may break differently) and the sampled acceptance
rate. `--dtype` repeats the checks with the model converted to each dtype (`model.to(dtype)`) and
reports them per dtype. Exit status 1 when a speculative mode differs from its plain mode in any.

    python recipes/device_check.py --device cuda --sentences 20
    python recipes/device_check.py --device cuda --sentences 8 --compile    # the compiled static path
    python recipes/device_check.py --device cuda --sentences 8 --dtype float32 bfloat16
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tts_specdec import SpeculativeDecoder  # noqa: E402
from tts_specdec.results import DecodeStats  # noqa: E402
from tts_specdec.inputs import MAX_BEAM_SIZE  # noqa: E402
from tts_specdec.speech import cli, load_speech_model  # noqa: E402
from tts_specdec.speech.pipeline import default_max_length  # noqa: E402
from tts_specdec.speech.references import heldout_sentences  # noqa: E402


def tokens(decoded) -> list[list[int]]:
    return [t.tolist() for t in decoded.tokens]


def main(argv: list[str] | None = None) -> int:
    p = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sentences", type=int, default=20)
    p.add_argument("--batch", type=int, default=4, help="sentences decoded together in the batch checks")
    p.add_argument("--beam-size", type=cli.int_in(1, MAX_BEAM_SIZE), default=4)
    p.add_argument("--compile", nargs="?", const=True, default=False, metavar="BACKEND",
                   help="check the compiled static path (SpeculativeDecoder(compile=...); CUDA graphs on a GPU)")
    p.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=["float32"],
                   help="the model's dtype(s): each is checked and reported on its own (default float32)")
    args = p.parse_args(argv)
    if args.sentences < 1 or args.batch < 1:
        raise ValueError("--sentences and --batch must be >= 1")

    texts = heldout_sentences(args.sentences)
    base = load_speech_model().model.eval()  # float32 on the CPU: read once, copied per dtype
    cpu_greedy = None
    if args.device != "cpu":  # the CPU's greedy tokens, which the device's are compared with (informational)
        cpu_dec = SpeculativeDecoder(base)
        cpu_greedy = [tokens(cpu_dec.sample(src, temperature=0.0, max_length=default_max_length(src)))[0]
                      for src in (base.tokenizer_encode([t]) for t in texts)]
    failed = {}
    for name in args.dtype:
        print(f"--- model in {name}")
        failed[name] = check_model(copy.deepcopy(base).to(args.device, DTYPES[name]), texts, args, cpu_greedy)
    for name, failures in failed.items():
        print(f"{name}: " + (f"FAILED ({len(failures)}):" if failures else "all speculative modes equal their plain modes"),
              *failures, sep="\n  ")
    return 1 if any(failed.values()) else 0


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model(model: torch.nn.Module, texts: list[str], args: argparse.Namespace,
                cpu_greedy: list[list[int]] | None) -> list[str]:
    """Every equivalence on `model` (on args.device): the names of those that do not hold. `cpu_greedy`
    (or None): the CPU's greedy tokens per sentence, which the device's are compared with (informational)."""
    dec = SpeculativeDecoder(model, compile=args.compile)
    sources = [model.tokenizer_encode([t]).to(args.device) for t in texts]
    failures: list[str] = []

    def check(name: str, got: object, want: object) -> None:
        if got != want:
            failures.append(name)

    greedy = []
    for i, src in enumerate(sources):
        n = default_max_length(src)
        plain = tokens(dec.sample(src, temperature=0.0, max_length=n))
        greedy.append(plain[0])
        for g in (1, 2, 4, 8):
            check(f"sentence {i}: greedy gamma={g}", tokens(dec.sample(src, temperature=0.0, gamma=g, max_length=n)), plain)
        check(f"sentence {i}: greedy gamma<=10 conf 0.9",
              tokens(dec.sample(src, temperature=0.0, gamma=10, draft_confidence=0.9, max_length=n)), plain)
        beam = dec.beam_search(src, beam_size=args.beam_size, max_length=n)
        for g, w in ((1, 8), (3, 12)):
            spec = dec.beam_search(src, beam_size=args.beam_size, gamma=g, draft_width=w, max_length=n)
            check(f"sentence {i}: beam gamma={g} W={w}", tokens(spec), tokens(beam))
            if not torch.allclose(torch.tensor(spec.scores), torch.tensor(beam.scores), rtol=1e-4, atol=1e-4):
                failures.append(f"sentence {i}: beam gamma={g} W={w} scores {spec.scores} vs {beam.scores}")
    path = "compiled" if args.compile else "default path"
    print(f"{args.device} ({path}): {len(sources)} sentences, greedy (gamma 1/2/4/8, draft stops) and beam {args.beam_size} "
          f"(gamma 1 W 8, gamma 3 W 12) checked")

    for start in range(0, len(texts), args.batch):
        chunk = texts[start:start + args.batch]
        if len(chunk) < 2:
            continue
        src = model.tokenizer_encode(chunk).to(args.device)
        n = default_max_length(src)
        alone = [tokens(dec.sample(model.tokenizer_encode([t]).to(args.device), temperature=0.0, max_length=n))[0]
                 for t in chunk]
        for g in (0, 4):
            check(f"batch at {start}: greedy gamma={g} rows vs alone",
                  tokens(dec.sample(src, temperature=0.0, gamma=g, max_length=n)), alone)
    print(f"{args.device}: batches of {args.batch} (greedy gamma 0 and 4) checked against each row alone")

    if cpu_greedy is not None:  # informational: the device's float sums are ordered differently
        same = sum(c == g for c, g in zip(cpu_greedy, greedy))
        print(f"greedy tokens equal to the CPU's on {same}/{len(sources)} sentences (not required)")

    gen = torch.Generator(device=args.device).manual_seed(0)
    stats = DecodeStats.total([dec.sample(src, gamma=4, generator=gen, max_length=default_max_length(src)).stats
                               for src in sources])
    print(f"sampling gamma=4: alpha {stats.alpha:.3f}, {stats.tokens_per_target_pass:.2f} tokens per target pass, "
          f"accepted histogram {stats.accepted_hist}")

    return failures


if __name__ == "__main__":
    raise SystemExit(main())
