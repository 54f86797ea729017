"""A seeded generator of varied short English sentences (2 to 12 words, numbers and punctuation).

The vocabulary is a few hundred common words in a handful of sentence shapes: small enough that a
tiny model trained for under an hour on CPU learns every word, varied enough that held-out sentences
are new combinations it has never heard.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NAMES = ("anna ben carla david emma frank grace henry iris jack kate leo maria nina oscar paul "
         "rosa sam tina victor").split()
ADJ = ("big small red blue green old new quiet loud happy sad warm cold bright dark soft hard "
       "fast slow tall short clean dirty heavy light empty full young strange lovely busy").split()
NOUN = ("cat dog bird house car tree river city garden window door book table chair apple "
        "letter train boat horse teacher doctor child friend kitchen school road market lamp "
        "phone bottle flower mountain song story cup coat ship forest island bridge clock").split()
VERB_PAST = ("saw found liked painted opened closed bought sold moved cleaned washed carried "
             "watched followed visited fixed broke built remembered wanted").split()
VERB = ("see find open close buy sell move clean wash carry watch follow visit fix build "
        "bring take read").split()
PREP = "near behind under over beside inside across around".split()
PLACE = ("at home", "in the park", "by the sea", "at school", "in the morning", "at night",
         "after lunch", "before dinner", "on monday", "on friday", "in june", "last week")
TIME_NOUN = ("minutes", "hours", "days", "weeks", "years")


def _pick(rng: random.Random, words) -> str:
    return words[rng.randrange(len(words))]


def _number(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.5:
        return str(rng.randint(2, 20))
    if roll < 0.85:
        return str(rng.randint(21, 99))
    if roll < 0.95:
        return str(rng.randint(100, 999))
    return f"{rng.randint(1, 9)}.{rng.randint(1, 9)}"


def _plural(noun: str) -> str:
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + ("es" if noun.endswith(("s", "x", "ch", "sh")) else "s")


def _name(rng: random.Random) -> str:
    return _pick(rng, NAMES).title()


def _the(rng: random.Random) -> str:
    adj = f"{_pick(rng, ADJ)} " if rng.random() < 0.5 else ""
    return f"the {adj}{_pick(rng, NOUN)}"


_SHAPES = (
    lambda r: f"{_name(r)} {_pick(r, VERB_PAST)} {_the(r)}.",
    lambda r: f"{_the(r).capitalize()} is {_pick(r, ADJ)}.",
    lambda r: f"{_the(r).capitalize()} is {_pick(r, PREP)} {_the(r)}.",
    lambda r: f"Is {_the(r)} {_pick(r, ADJ)}?",
    lambda r: f"{_name(r)}, please {_pick(r, VERB)} {_the(r)}.",
    lambda r: f"We {_pick(r, VERB_PAST)} {_number(r)} {_plural(_pick(r, NOUN))} {_pick(r, PLACE)}.",
    lambda r: f"It took {_number(r)} {_pick(r, TIME_NOUN)}!",
    lambda r: f"Did {_name(r)} {_pick(r, VERB)} {_the(r)} {_pick(r, PLACE)}?",
    lambda r: f"My {_pick(r, NOUN)} costs {_number(r)} dollars.",
    lambda r: f"{_name(r)} and {_name(r)} {_pick(r, VERB_PAST)} {_the(r)}.",
    lambda r: f"Oh no, {_the(r)} is {_pick(r, ADJ)}!",
    lambda r: f"{_the(r).capitalize()} {_pick(r, VERB_PAST)} {_the(r)} {_pick(r, PLACE)}.",
    lambda r: f"Hello, {_name(r)}!",
    lambda r: f"Open {_the(r)}!",
    lambda r: f"{_name(r)} and {_name(r)} {_pick(r, VERB_PAST)} {_the(r)} {_pick(r, PREP)} {_the(r)} {_pick(r, PLACE)}.",
    lambda r: f"Don't {_pick(r, VERB)} {_the(r)}.",
    lambda r: f"There are {_number(r)} {_pick(r, ADJ)} {_plural(_pick(r, NOUN))}.",
)


@dataclass(frozen=True)
class SentenceSplit:
    train: list[str]
    heldout: list[str]


def generate_sentences(n: int, seed: int = 0, min_words: int = 2, max_words: int = 12) -> list[str]:
    """`n` distinct sentences of `min_words`..`max_words` words, deterministic in `seed`."""
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    rng = random.Random(seed)
    seen: dict[str, None] = {}
    attempts = 0
    while len(seen) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(f"cannot find {n} distinct sentences; lower n")
        sentence = _pick(rng, _SHAPES)(rng)
        if min_words <= len(sentence.split()) <= max_words:
            seen.setdefault(sentence, None)
    return list(seen)


def split_sentences(n_train: int, n_heldout: int, seed: int = 0) -> SentenceSplit:
    """Disjoint train and held-out sentence lists (held-out sentences never occur in train)."""
    sentences = generate_sentences(n_train + n_heldout, seed=seed)
    return SentenceSplit(train=sentences[n_heldout:], heldout=sentences[:n_heldout])
