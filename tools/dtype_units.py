"""How much of a model's greedy output survives converting it to bfloat16: the shipped model (or a
checkpoint) and its `model.to(torch.bfloat16)` copy decode the same held-out sentences greedily; reports
the sentences whose units are identical and the share of units equal position by position (up to the
shorter of the two; a length difference counts its extra units as different).

    .venv/bin/python tools/dtype_units.py --n 50 [--checkpoint DIR] [--json F]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

from tts_specdec import SpeculativeDecoder
from tts_specdec.speech import load_default, load_speech_model
from tts_specdec.speech.atomic import write_json
from tts_specdec.speech.pipeline import default_max_length
from tts_specdec.speech.references import heldout_sentences


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=50, help="held-out sentences")
    p.add_argument("--checkpoint", type=Path, help="checkpoint folder (default: the shipped one)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    speech = load_default() if args.checkpoint is None else load_speech_model(args.checkpoint)
    models = {"float32": speech.model, "bfloat16": copy.deepcopy(speech.model).to(torch.bfloat16)}
    units: dict[str, list[list[int]]] = {name: [] for name in models}
    for text in heldout_sentences(args.n):
        source = speech.tokenizer([text])
        for name, model in models.items():
            out = SpeculativeDecoder(model).sample(source, temperature=0.0, max_length=default_max_length(source))
            units[name].append(out.tokens[0].tolist())
    same = sum(a == b for a, b in zip(units["float32"], units["bfloat16"]))
    equal = sum(sum(x == y for x, y in zip(a, b)) for a, b in zip(units["float32"], units["bfloat16"]))
    total = sum(max(len(a), len(b)) for a, b in zip(units["float32"], units["bfloat16"]))
    print(f"{args.n} held-out sentences, greedy: identical units in {same} ({same / args.n:.0%}); "
          f"units equal position by position: {equal / total:.1%} of {total}")
    if args.json:
        out = {"command": " ".join(["tools/dtype_units.py", *sys.argv[1:]]), "sentences": args.n,
               "identical_sentences": same, "equal_units": equal, "units": total}
        write_json(args.json, out)


if __name__ == "__main__":
    main()
