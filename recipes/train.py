"""Train the default model: k-means units on the corpus, then TextToSemantic with an early-exit head.

    python recipes/make_corpus.py
    python recipes/train.py                     # -> runs/default/{units.safetensors,pairs_*.safetensors,checkpoint/}
    python recipes/train.py --ship              # also copy the checkpoint into tts_specdec/assets/
    python recipes/train.py --init-from tts_specdec/assets --steps 0 --distill-steps 0 \
        --draft-distill 12000 --ship            # only refit the shipped exit head (trunk frozen)

Deterministic for a given --seed (2 CPU threads); each stage is cached in the run directory, as
safetensors and JSON only: nothing in --run is unpickled. `--kmeans FILE` takes an external k-means
model in audiolm's joblib format instead of fitting one; joblib is pickle, which runs code when read,
so it is read only because you name it: pass only a file you trust.
User errors (missing files, a folder that cannot be written, bad numbers) print one line and exit with
status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

# Spinning OpenMP workers stall for seconds per op when another process shares the cores; passive
# waiting avoids that stall. Must precede `import torch`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from tts_specdec.speech import cli
from tts_specdec.speech.checkpoint import FILES, Checkpoint, load_checkpoint, save_checkpoint
from tts_specdec.speech.corpus import METADATA
from tts_specdec.speech.dataset import PairedData, corpus_frames, extract_pairs, load_pairs, save_pairs
from tts_specdec.speech.model import ModelConfig, build_model
from tts_specdec.speech.tokenizer import CharTokenizer
from tts_specdec.distill import distill_exit_head as distill_on_samples
from tts_specdec.speech.self_distill import greedy_pairs
from tts_specdec.speech.sentences import generate_sentences
from tts_specdec.speech.training import TrainConfig, diagnostics, distill_exit_head, train
from tts_specdec.speech.units import MelKMeans, fit_kmeans, load_centroids, save_centroids

ASSETS = Path(__file__).resolve().parents[1] / "tts_specdec" / "assets"


def load_or_extract(path: Path, root: Path, tokenizer: CharTokenizer, extractor: MelKMeans) -> PairedData:
    if path.exists():
        return load_pairs(path)
    data = extract_pairs(root, tokenizer, extractor)
    save_pairs(data, path)
    return data


def units_of_run(args) -> MelKMeans:
    """The run's k-means units: --kmeans (an external joblib, read because the user named it), else
    DIR/units.safetensors, fitted on the corpus the first time. A DIR/kmeans.joblib of an older run is
    never read (a file planted there would run code)."""
    if args.kmeans is not None:
        try:
            extractor = MelKMeans.from_joblib(args.kmeans)
        except Exception as error:  # noqa: BLE001 - whatever unpickling a wrong file raises: the user's file
            raise ValueError(f"--kmeans: {args.kmeans} is not a k-means model in audiolm's joblib format "
                             f"({type(error).__name__}: {error})") from None
        save_centroids(extractor.centroids, args.run / "units.safetensors")
        return extractor
    path = args.run / "units.safetensors"
    if not path.exists():
        if (args.run / "kmeans.joblib").exists():
            print(f"{args.run / 'kmeans.joblib'} is not read (pickle); pass --kmeans to use it. Fitting k-means.")
        frames = corpus_frames(args.corpus / "train", args.kmeans_utterances, seed=args.seed)
        save_centroids(torch.from_numpy(fit_kmeans(frames, args.n_units, seed=args.seed).cluster_centers_), path)
    return MelKMeans(load_centroids(path))


def corpus_split(corpus: Path, split: str) -> Path:
    """corpus/split, which must hold a metadata file (checked before any work that reads it)."""
    root = corpus / split
    if not (root / METADATA).is_file():
        raise FileNotFoundError(f"--corpus: no {root / METADATA} (recipes/make_corpus.py makes a corpus)")
    return root


def main() -> None:
    parser = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    count, positive = cli.int_at_least(0), cli.int_at_least(1)
    parser.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    parser.add_argument("--run", type=Path, default=Path("runs/default"))
    parser.add_argument("--kmeans", type=Path, help="an external k-means model in audiolm's joblib format "
                        "(pickle: read because you name it; only a file you trust)")
    parser.add_argument("--n-units", type=cli.int_at_least(2), default=128)
    parser.add_argument("--kmeans-utterances", type=positive, default=1500)
    parser.add_argument("--steps", type=count, default=TrainConfig.steps)
    parser.add_argument("--distill-steps", type=count, default=TrainConfig.distill_steps)
    parser.add_argument("--max-frames", type=positive, default=TrainConfig.max_frames)
    parser.add_argument("--lr", type=cli.float_in(0.0), default=TrainConfig.lr)
    parser.add_argument("--dim", type=positive, default=ModelConfig.dim)
    parser.add_argument("--target-depth", type=positive, default=ModelConfig.target_depth)
    parser.add_argument("--source-depth", type=positive, default=ModelConfig.source_depth)
    parser.add_argument("--early-exit-layer", type=positive, default=ModelConfig.target_early_exit_layer)
    parser.add_argument("--ff-mult", type=positive, default=ModelConfig.ff_mult)
    parser.add_argument("--warmup", type=count, default=TrainConfig.warmup)
    parser.add_argument("--init-from", type=Path, help="start from this checkpoint's weights (fresh optimizer)")
    parser.add_argument("--checkpoint-every", type=positive, default=500)
    parser.add_argument("--max-minutes", type=cli.float_in(0.0),
                        help="end phase 1 early after this long (breaks determinism)")
    parser.add_argument("--self-distill", type=count, default=0,
                        help="then distil the exit head on the model's own greedy units for this many sentences")
    parser.add_argument("--self-distill-steps", type=count, default=300)
    parser.add_argument("--draft-distill", type=count, default=0,
                        help="last, fit the exit head (TV loss, trunk frozen) to the model's own samples on this "
                             "many new sentences (in neither the training nor the held-out set)")
    parser.add_argument("--draft-distill-steps", type=count, default=8000)
    parser.add_argument("--seed", type=count, default=0)
    parser.add_argument("--threads", type=positive, default=2)
    parser.add_argument("--ship", action="store_true", help="copy the result into tts_specdec/assets")
    args = parser.parse_args()
    if args.early_exit_layer > args.target_depth:
        parser.error(f"--early-exit-layer must be in 1..{args.target_depth} (--target-depth), got {args.early_exit_layer}")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = CharTokenizer()

    # what the command names (folders, files, a checkpoint) is checked and read here: a mistake there is
    # one line and exit status 2; training below keeps its tracebacks
    with cli.user_errors(parser.prog):
        cli.writable_folder(args.run, "--run")
        init = None
        if args.init_from:
            try:
                init = load_checkpoint(args.init_from)
            except cli.USER_ERRORS as error:
                raise ValueError(f"--init-from: {str(error).splitlines()[0]}") from None
        if args.kmeans is not None:
            cli.readable_file(args.kmeans, "--kmeans")
        elif not (args.run / "units.safetensors").exists():
            corpus_split(args.corpus, "train")
        extractor = units_of_run(args)
        if init is not None and not torch.equal(init.centroids, extractor.centroids):
            raise ValueError(f"--init-from {args.init_from} was trained on other k-means units")
        # the cached pairs hold units of these centroids: their name says which
        tag = fingerprint(extractor.centroids)
        pairs = {split: args.run / f"pairs_{split}.{tag}.safetensors" for split in ("train", "heldout")}
        for split, path in pairs.items():
            if not path.exists():
                corpus_split(args.corpus, split)
        train_data = load_or_extract(pairs["train"], args.corpus / "train", tokenizer, extractor)
        heldout = load_or_extract(pairs["heldout"], args.corpus / "heldout", tokenizer, extractor)

    config = ModelConfig(n_units=extractor.codebook_size, num_text_token_ids=tokenizer.num_text_token_ids,
                         dim=args.dim, source_depth=args.source_depth, target_depth=args.target_depth,
                         target_early_exit_layer=args.early_exit_layer, ff_mult=args.ff_mult)
    train_config = TrainConfig(steps=args.steps, distill_steps=args.distill_steps, max_frames=args.max_frames,
                               lr=args.lr, warmup=args.warmup, seed=args.seed,
                               cond_drop_prob=config.cond_drop_prob, max_minutes=args.max_minutes)
    lineage = {}
    if init is not None:
        config, model = init.config, init.model
        lineage = {"init_from": str(args.init_from), "init_meta": init.meta}
    else:
        model = build_model(config, tokenizer_encode=tokenizer)

    def snapshot(step: int, stats: dict) -> None:
        meta = {"step": step, "diagnostics": stats}
        save_checkpoint(args.run / "latest", Checkpoint(model, config, tokenizer, extractor.centroids, meta=meta))

    started = time.time()
    result = train(model, train_data, train_config, validation=heldout, on_checkpoint=snapshot,
                   checkpoint_every=args.checkpoint_every)
    if args.self_distill:
        own = greedy_pairs(model, train_data, args.self_distill, seed=args.seed)
        distill_exit_head(model, own, train_config, args.self_distill_steps, args.seed + 2)
        model.eval()
        lineage["self_distill"] = {"sentences": args.self_distill, "steps": args.self_distill_steps,
                                   "diagnostics": diagnostics(model, heldout)}
        print(f"after self-distillation: {lineage['self_distill']['diagnostics']}")
    if args.draft_distill:
        lineage["draft_distill"] = draft_distill(model, args.draft_distill, args.draft_distill_steps,
                                                 set(train_data.texts) | set(heldout.texts), args.seed)
    meta = {**lineage, "train": dataclasses.asdict(train_config), "result": dataclasses.asdict(result),
            "corpus": str(args.corpus), "train_utterances": len(train_data),
            "train_minutes": round((time.time() - started) / 60, 1), "threads": args.threads}
    out = save_checkpoint(args.run / "checkpoint",
                          Checkpoint(model, config, tokenizer, extractor.centroids, meta=meta))
    print(json.dumps(meta, indent=2))
    if args.ship:
        ASSETS.mkdir(exist_ok=True)
        for name in FILES:
            shutil.copy(out / name, ASSETS / name)
        print(f"shipped to {ASSETS}")


def fingerprint(tensor: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(tensor.float().contiguous().numpy().tobytes()).hexdigest()[:12]


def draft_distill(model, n: int, steps: int, exclude: set[str], seed: int) -> dict:
    """The exit head fitted to the target's samples on `n` sentences it was not trained on: on its
    training sentences the target is surer than on new text, and a head fitted there does not carry
    over (shipped model: held-out acceptance 0.847 -> 0.850 that way, -> ~0.865 on new sentences)."""
    texts = [t for t in generate_sentences(n + len(exclude), seed=seed + 1000) if t not in exclude][:n]
    result = distill_on_samples(model, texts, seq_len=400, steps=steps, batch=1024, lr=5e-4, loss="tv",
                                holdout=0.1, eval_every=100, seed=seed, progress=True)
    model.eval()
    summary = {"sentences": len(texts), "steps": steps, "best_step": result.best_step,
               "acceptance_before": round(result.acceptance_before, 4),
               "acceptance_after": round(result.acceptance_after, 4),
               "positions": result.train_positions + result.heldout_positions}
    print(f"draft distillation: {summary}")
    return summary


if __name__ == "__main__":
    main()
