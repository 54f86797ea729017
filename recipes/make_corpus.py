"""Build the training corpus: generated English sentences spoken by espeak-ng (LJSpeech layout).

    python recipes/make_corpus.py                       # data/corpus/{train,heldout}
    python recipes/make_corpus.py --ljspeech ~/LJSpeech-1.1 --out data/lj   # reuse a real corpus

Resumable: wavs that already exist are kept.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tqdm import tqdm

from tts_specdec.speech.audio import read_wav, write_wav
from tts_specdec.speech.corpus import ESPEAK_RATE, Utterance, read_metadata, speak_corpus, wav_path, write_metadata
from tts_specdec.speech.sentences import split_sentences


def import_ljspeech(src: Path, out: Path) -> None:
    """Copy an LJSpeech-layout corpus as 16 kHz mono wavs (the unit extractor's rate)."""
    utterances = read_metadata(src)
    write_metadata(out, utterances)
    for u in tqdm(utterances, desc=f"{src} -> {out}", unit="utt"):
        target = wav_path(out, u.id)
        if not target.exists():
            write_wav(target, read_wav(wav_path(src, u.id)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("data/corpus"))
    parser.add_argument("--n-train", type=int, default=6000)
    parser.add_argument("--n-heldout", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=int, default=ESPEAK_RATE, help="espeak-ng words per minute")
    parser.add_argument("--voice", default="en-us")
    parser.add_argument("--ljspeech", type=Path, help="existing LJSpeech-layout corpus to import instead")
    args = parser.parse_args()

    if args.ljspeech:
        import_ljspeech(args.ljspeech, args.out)
        return
    split = split_sentences(args.n_train, args.n_heldout, seed=args.seed)
    for name, sentences in (("heldout", split.heldout), ("train", split.train)):
        utterances = [Utterance(f"{name}_{i:05d}", s) for i, s in enumerate(sentences)]
        speak_corpus(args.out / name, utterances, voice=args.voice, rate=args.rate)


if __name__ == "__main__":
    main()
