"""Text normalisation shared by the corpus, the tokenizer and the recipes.

What happens to a sentence before it is tokenized (documented here because the tokenizer's
behaviour on unusual input depends on it):

- Unicode is NFKD-decomposed and accents are dropped ("café" -> "cafe"); text is lowercased.
- Digit runs become English words by our own code: "42" -> "forty two", "3.5" -> "three point five",
  "1,200" -> "one thousand two hundred". Integers up to 999 999 999 999 are spelled out;
  longer digit runs are read digit by digit.
- ";" and ":" become ","; quotes, brackets and "*" are removed; "&" becomes "and", "%" "percent".
- Whitespace is collapsed.
Anything still outside `ALPHABET` afterwards is an error (the tokenizer raises ValueError naming it).
"""

from __future__ import annotations

import re
import unicodedata

ALPHABET = "abcdefghijklmnopqrstuvwxyz '.,?!-"

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
         "fifteen sixteen seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = ((10**9, "billion"), (10**6, "million"), (1000, "thousand"))

_MAPPED = {";": ",", ":": ",", "&": " and ", "%": " percent", "\u2019": "'", "\u2018": "'"}
_REMOVED = set('"()[]{}*\u201c\u201d')


def _below_thousand(n: int) -> list[str]:
    words: list[str] = []
    if n >= 100:
        words += [_ONES[n // 100], "hundred"]
        n %= 100
    if n >= 20:
        words.append(_TENS[n // 10])
        n %= 10
        if n:
            words.append(_ONES[n])
    elif n or not words:
        words.append(_ONES[n])
    return words


def number_to_words(n: int) -> str:
    """Spell a non-negative integer in English words ("1203" -> "one thousand two hundred three")."""
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    if n >= 10**12:
        return " ".join(_ONES[int(d)] for d in str(n))
    words: list[str] = []
    for scale, name in _SCALES:
        if n >= scale:
            words += _below_thousand(n // scale) + [name]
            n %= scale
    if n or not words:
        words += _below_thousand(n)
    return " ".join(words)


def _spell_number(match: re.Match) -> str:
    whole, frac = match.group(1).replace(",", ""), match.group(2)
    words = number_to_words(int(whole))
    if frac:
        words += " point " + " ".join(_ONES[int(d)] for d in frac)
    return f" {words} "


_NUMBER = re.compile(r"(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?")


def normalize_text(text: str) -> str:
    """Normalise `text` as described in the module docstring (does not validate the alphabet)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c))
    text = _NUMBER.sub(_spell_number, text.lower())
    text = "".join(_MAPPED.get(c, "" if c in _REMOVED else c) for c in text)
    text = re.sub(r"\s+", " ", text).strip()
    return re.sub(r" ([.,?!])", r"\1", text)
