"""Text to speech with the shipped model, in every decoding mode.

    python recipes/synthesize.py                                   # the demo: samples/ + samples/README.md
    python recipes/synthesize.py "Any text." --mode spec-beam --out out.wav
    python recipes/synthesize.py --texts lines.txt --out wavs/     # one wav per line + wavs/manifest.jsonl
    torchrun --nproc_per_node 2 recipes/synthesize.py --texts lines.txt --out wavs/ --threads 1

--texts is a resumable job: wavs/NNNNN.wav for input line NNNNN (1-based) and one manifest entry per line;
a rerun skips lines already made with the same text and settings and redoes the rest; a line that fails
is recorded and the others go on (exit status 1 if any failed). Under torchrun (or accelerate launch)
the processes share the lines and write what one process writes (docs/scale-out.md).
User errors (missing files, bad numbers) print one line and exit with status 2.

Modes (tts_specdec.speech.MODES): plain (greedy), spec (greedy speculative, gamma 4), beam (beam 4),
spec-beam (speculative beam search, beam 4, gamma 1, draft width 8). Nothing is downloaded; espeak-ng is only
needed for the quality figures of the demo (they are skipped with a message without it).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

from tts_specdec.speech import MODES, SpeechModel, load_default, load_speech_model, synthesize
from tts_specdec.speech import batch, cli
from tts_specdec.speech.audio import write_wav
from tts_specdec.speech.atomic import write_text
from tts_specdec.speech.longtext import MAX_PIECE_CHARS
from tts_specdec.inputs import MAX_COND_SCALE
from tts_specdec.speech.pipeline import DEFAULT_COND_SCALE
from tts_specdec.speech.evaluation import run_mode, vocoder_ceiling
from tts_specdec.speech.references import heldout_sentences, reference_wavs
from tts_specdec.speech.report import markdown_table, spectrogram_figure

SAMPLES = Path(__file__).resolve().parents[1] / "samples"


def one(speech: SpeechModel, text: str, mode: str, out: Path, cond_scale: float, seed: int, max_chars: int) -> None:
    result = synthesize(speech, [text], mode, cond_scale=cond_scale, seed=seed, max_chars=max_chars)
    write_wav(out, result.wavs[0])
    stats = result.stats
    print(f"{out}: {result.audio_seconds:.2f} s of audio ({result.pieces[0]} pieces), {stats.generated_tokens} "
          f"units in {result.decode_seconds:.2f} s ({stats.tokens_per_second:.0f} tokens/s, mode {mode})")


def processes(device: str) -> batch.Processes:
    """accelerate's process state under torchrun / accelerate launch or on a GPU; one process otherwise."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and device == "cpu":
        return batch.SingleProcess()
    from accelerate import PartialState

    return PartialState(cpu=device == "cpu")


def many(speech: SpeechModel, texts_file: Path, out_dir: Path, settings: batch.Settings, batch_size: int,
         state: batch.Processes) -> int:
    """The --texts job; returns the exit status (1 if any line failed)."""
    report = batch.run(speech, texts_file, out_dir, settings, batch_size=batch_size, processes=state)
    if not state.is_main_process:
        return 0
    print(f"{out_dir}/: {len(report.entries)} lines: {report.ok} ok ({report.reused} kept from an earlier run), "
          f"{report.blank} blank, {len(report.failed)} failed; {report.made} lines decoded by {state.num_processes} "
          f"processes in {report.seconds:.1f} s; {report.manifest}")
    for entry in report.failed[:20]:
        print(f"  {entry.error}", file=sys.stderr)
    if len(report.failed) > 20:
        print(f"  ... and {len(report.failed) - 20} more (status \"error\" in the manifest)", file=sys.stderr)
    return 1 if report.failed else 0


BF16 = "plain-bf16"  # the demo's row of greedy decoding with the model converted to bfloat16


def demo(speech: SpeechModel, out_dir: Path, n_eval: int, n_samples: int, modes: list[str],
         cond_scale: float) -> None:
    """The main job: every mode on held-out sentences; wavs, a spectrogram figure and a report."""
    texts = heldout_sentences(n_eval)
    references = reference_wavs(texts)
    if references is None:
        print("espeak-ng not found: quality figures skipped (install espeak-ng to compute them); "
              f"synthesising the {n_samples} sample sentences only")
        texts = texts[:n_samples]
    started = time.time()
    results = {}
    runs = [(mode, mode, speech) for mode in modes]
    if "plain" in modes:  # greedy decoding again with the model in bfloat16 (half the bytes on the kernels)
        half = dataclasses.replace(speech, model=copy.deepcopy(speech.model).to(torch.bfloat16))
        runs.append((BF16, "plain", half))
    for name, mode, model in runs:
        results[name] = r = run_mode(model, texts, mode, references=references, cond_scale=cond_scale)
        r.mode = name
        print(f"{name:>10}: {r.tokens_per_second:6.0f} tokens/s, RTF {r.real_time_factor:.3f}, "
              f"{r.tokens_per_target_pass:.2f} tokens per target pass"
              + ("" if r.quality is None else f", content-ID {r.quality.content_id_accuracy:.0%}, "
                 f"duration ok {r.quality.duration_pass_rate:.0%}"))
    ceiling = vocoder_ceiling(speech, references) if references is not None else None

    ids = [f"heldout_{i:05d}" for i in range(n_samples)]
    for mode, r in results.items():
        for uid, wav in zip(ids, r.wavs):
            write_wav(out_dir / mode / f"{uid}.wav", wav)
    if references is not None:
        for uid, wav in zip(ids, references):
            write_wav(out_dir / "reference" / f"{uid}.wav", wav)
    panels = {mode: r.wavs[0] for mode, r in results.items()}
    if references is not None:
        panels["espeak-ng reference"] = references[0]
    spectrogram_figure(out_dir / "spectrograms.png", texts[0], panels)

    units = {mode: [u for s in r.syntheses for u in s.units] for mode, r in results.items()}
    identical = {}
    for fast, slow in (("spec", "plain"), ("spec-beam", "beam")):
        if fast in units and slow in units:
            same = all(torch.equal(a, b) for a, b in zip(units[fast], units[slow]))
            identical[fast] = f"`{slow}`: {'yes' if same else 'NO'}"
    if BF16 in units and "plain" in units:  # bfloat16 weights are other weights: a share, not a check
        same = sum(torch.equal(a, b) for a, b in zip(units["plain"], units[BF16]))
        identical[BF16] = f"`plain`: {same} of {len(units['plain'])}"
    write_readme(out_dir, speech, list(results.values()), ceiling, identical, texts, ids, n_samples,
                 time.time() - started, cond_scale)
    print(f"wrote {out_dir}/ in {time.time() - started:.0f} s")


def write_readme(out_dir: Path, speech: SpeechModel, results, ceiling, identical, texts, ids,
                 n_samples: int, seconds: float, cond_scale: float) -> None:
    config = speech.config
    n = results[0].utterances if results else 0
    lines = [
        "# Samples: the shipped model in every decoding mode",
        "",
        "Written by `python recipes/synthesize.py` (`make demo`) from the checkpoint in "
        "`tts_specdec/assets/`, on held-out sentences the model never saw in training. "
        f"Figures over {n} sentences, decoded one at a time (batch 1) on this machine's CPU "
        f"({torch.get_num_threads()} threads); the whole run took {seconds:.0f} s.",
        "",
        "Modes: " + "; ".join(f"`{name}` = {mode.describe()}" for name, mode in MODES.items()) + ". "
        "Greedy is used for the sampling modes so that `plain` and "
        "`spec` can be compared unit for unit; with temperature > 0 speculative sampling keeps the "
        "target's distribution but not the same draws. `plain-bf16` is `plain` with the model converted "
        "by `model.to(torch.bfloat16)` (other weights, so other units in some sentences; on the CPU "
        "kernels its weights stream at half the bytes). Classifier-free guidance scale "
        f"(`cond_scale`) {cond_scale:g} in every mode.",
        "",
        markdown_table(results, ceiling, identical),
        "- tokens/s: semantic units generated per second of decoding (50 units = 1 s of audio).",
        "- real-time factor: (decoding + vocoding time) / audio duration.",
        "- tokens per target pass: units (sampling) or beam steps (beam search) committed per pass of "
        "the full decoder; accepted drafts per pass excludes the target's own bonus/correction token.",
        "- content-ID accuracy: share of generated utterances whose nearest espeak-ng reference under "
        "length-normalised DTW on log-mel frames is their own sentence; duration ratio = "
        "generated / reference duration. The ceiling row puts the reference's own k-means units "
        "through the same vocoder.",
        "",
        f"Model: TextToSemantic dim {config.dim}, encoder depth {config.source_depth}, decoder depth "
        f"{config.target_depth}, early exit after layer {config.target_early_exit_layer}, "
        f"{config.n_units} k-means units of 80-band log-mel at 50 frames/s; centroid log-mel + "
        "Griffin-Lim vocoder.",
        "",
        "## Files",
        "",
        "- `spectrograms.png`: the first sentence in every mode"
        + (" and the espeak-ng reference" if ceiling is not None else ""),
    ]
    for mode in [r.mode for r in results] + (["reference"] if ceiling is not None else []):
        lines.append(f"- `{mode}/`: " + ", ".join(f"`{uid}.wav`" for uid in ids))
    lines += ["", "| id | text |", "|---|---|"]
    lines += [f"| {uid} | {text} |" for uid, text in zip(ids, texts[:n_samples])]
    write_text(out_dir / "README.md", "\n".join(lines) + "\n")


def main() -> int:
    parser = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("text", nargs="?", help="one text to speak (writes --out)")
    parser.add_argument("--mode", choices=sorted(MODES), default="spec-beam")
    parser.add_argument("--out", type=Path, help="wav file (one text) or folder (--texts, demo)")
    parser.add_argument("--texts", type=Path, help="text file, one text per line (UTF-8)")
    parser.add_argument("--batch-size", type=cli.int_at_least(1), default=8, help="--texts: lines per decoding call")
    parser.add_argument("--checkpoint", type=Path, help="checkpoint folder (default: the shipped one)")
    parser.add_argument("--n-eval", type=cli.int_at_least(1), default=50, help="demo: held-out sentences to score")
    parser.add_argument("--n-samples", type=cli.int_at_least(1), default=5, help="demo: sentences whose wavs are kept")
    parser.add_argument("--modes", default="plain,spec,beam,spec-beam", help="demo: comma-separated modes")
    parser.add_argument("--cond-scale", type=cli.float_in(1.0, MAX_COND_SCALE), default=DEFAULT_COND_SCALE,
                        help="classifier-free guidance scale (1 = off)")
    parser.add_argument("--seed", type=cli.int_at_least(0), default=0,
                        help="sampling seed (a batch is seeded with seed + its first line)")
    parser.add_argument("--max-chars", type=cli.int_at_least(20), default=MAX_PIECE_CHARS,
                        help="longest piece of text decoded as one row (texts are cut at sentence ends too)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the decoder runs (under torchrun on GPUs: each process its own GPU)")
    parser.add_argument("--threads", type=cli.int_at_least(1), default=2, help="CPU threads per process")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the text-to-semantic model's weights (bfloat16: half the bytes; every mode stays exact)")
    args = parser.parse_args()

    if args.text is not None and args.texts is not None:
        parser.error("give either a text or --texts, not both")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        parser.error(f"--modes: unknown {unknown}; choose from {sorted(MODES)}")
    if args.n_samples > args.n_eval:
        parser.error("--n-samples must be between 1 and --n-eval")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    with cli.user_errors(parser.prog):
        if args.texts is not None:
            cli.readable_file(args.texts, "--texts")
            out = cli.writable_folder(args.out or Path("out"), "--out")
        elif args.text is not None:
            out = args.out or Path("out.wav")
            if out.is_dir():
                raise IsADirectoryError(f"--out: {out} is a folder; give a .wav file name")
            cli.writable_folder(out.parent, "--out")
        else:
            out = cli.writable_folder(args.out or SAMPLES, "--out")
        state = processes(args.device) if args.texts is not None else None
        torch.set_num_threads(args.threads)  # after accelerate, which sets its own per-process default
        speech = load_default() if args.checkpoint is None else load_speech_model(args.checkpoint)
        device = state.device if state is not None and hasattr(state, "device") else torch.device(args.device)
        speech.model.to(device, getattr(torch, args.dtype))
        if args.text is not None:
            one(speech, args.text, args.mode, out, args.cond_scale, args.seed, args.max_chars)
            return 0
    if args.texts is not None:
        settings = batch.Settings(args.mode, args.cond_scale, args.seed, args.max_chars,
                                  "shipped" if args.checkpoint is None else str(args.checkpoint.resolve()), args.dtype)
        return many(speech, args.texts, out, settings, args.batch_size, state)
    demo(speech, out, args.n_eval, args.n_samples, modes, args.cond_scale)
    return 0


if __name__ == "__main__":
    sys.exit(main())
