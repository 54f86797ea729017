"""Quality and speed figures on held-out sentences (needs espeak-ng for the references).

    python recipes/evaluate.py                                   # shipped model, 50 sentences, all modes
    python recipes/evaluate.py --checkpoint runs/default/latest --modes plain,beam --n 20
    python recipes/evaluate.py --modes plain,beam --dtype bfloat16 --json bf16.json   # the model in bfloat16

Content-ID accuracy: share of generated utterances whose nearest espeak-ng reference under
length-normalised DTW on log-mel frames is their own sentence. Duration ratio: generated / reference.
The ceiling row does the same for the references' own units put through the vocoder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from tts_specdec.speech import MODES, load_default, load_speech_model
from tts_specdec.speech.pipeline import DEFAULT_COND_SCALE
from tts_specdec.speech.evaluation import run_mode, vocoder_ceiling
from tts_specdec.speech.references import heldout_sentences, reference_wavs
from tts_specdec.speech.report import markdown_table
from tts_specdec.speech.atomic import write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="checkpoint folder (default: the shipped one)")
    parser.add_argument("--n", type=int, default=50, help="held-out sentences")
    parser.add_argument("--modes", default="plain,spec,beam,spec-beam")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--cond-scale", type=float, default=DEFAULT_COND_SCALE, help="classifier-free guidance scale")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the text-to-semantic model's weights (model.to(dtype))")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes: choose from {sorted(MODES)}")
    if args.n < 2:
        parser.error("--n must be at least 2 (content-ID needs competitors)")
    texts = heldout_sentences(args.n)
    references = reference_wavs(texts)
    if references is None:
        sys.exit("espeak-ng is not installed: no references, so no quality figures (apt-get install espeak-ng)")
    speech = load_default() if args.checkpoint is None else load_speech_model(args.checkpoint)
    speech.model.to(getattr(torch, args.dtype))
    results = [run_mode(speech, texts, m, batch_size=args.batch_size, references=references,
                        cond_scale=args.cond_scale) for m in modes]
    ceiling = vocoder_ceiling(speech, references)
    print(markdown_table(results, ceiling, {}))
    if args.json:
        figures = {r.mode: {"tokens_per_second": r.tokens_per_second, "real_time_factor": r.real_time_factor,
                            "tokens_per_target_pass": r.tokens_per_target_pass,
                            "accepted_per_pass": r.accepted_per_pass,
                            "content_id_accuracy": r.quality.content_id_accuracy,
                            "duration_pass_rate": r.quality.duration_pass_rate,
                            "duration_ratios": r.quality.duration_ratios} for r in results}
        figures["vocoder_ceiling"] = {"content_id_accuracy": ceiling.content_id_accuracy,
                                      "duration_pass_rate": ceiling.duration_pass_rate}
        write_json(args.json, figures, indent=2)


if __name__ == "__main__":
    main()
