"""Text normalisation, sentence generator and character tokenizer."""

import pytest
import torch

from tts_specdec.speech.sentences import generate_sentences, split_sentences
from tts_specdec.speech.text import ALPHABET, normalize_text, number_to_words
from tts_specdec.speech.tokenizer import PAD_ID, CharTokenizer


@pytest.mark.parametrize("n, words", [(0, "zero"), (7, "seven"), (42, "forty two"), (100, "one hundred"),
                                      (1203, "one thousand two hundred three"),
                                      (2_000_019, "two million nineteen")])
def test_number_to_words(n, words):
    assert number_to_words(n) == words


def test_normalize_text_expands_numbers_and_maps_punctuation():
    assert normalize_text('It costs 1,203.5 dollars; "really"  Café!') == \
        "it costs one thousand two hundred three point five dollars, really cafe!"


def test_sentences_are_deterministic_distinct_and_in_range():
    a, b = generate_sentences(300, seed=3), generate_sentences(300, seed=3)
    assert a == b and len(set(a)) == 300
    assert all(2 <= len(s.split()) <= 12 for s in a)
    assert all(set(normalize_text(s)) <= set(ALPHABET) for s in a)
    assert any(any(c.isdigit() for c in s) for s in a) and any("?" in s for s in a)


def test_heldout_never_in_train():
    split = split_sentences(500, 50, seed=0)
    assert len(split.heldout) == 50 and not set(split.heldout) & set(split.train)
    assert split.heldout == generate_sentences(50, seed=0)  # independent of the training-set size


def test_tokenizer_pads_right_with_pad_id():
    tok = CharTokenizer()
    ids = tok(["ab", "a"])
    assert ids.tolist() == [[1, 2], [1, PAD_ID]]
    assert tok.num_text_token_ids == len(ALPHABET) + 1


@pytest.mark.parametrize("text", ["", "   ", '""'])
def test_tokenizer_rejects_empty_text(text):
    with pytest.raises(ValueError, match="text"):
        CharTokenizer()([text])


def test_tokenizer_rejects_characters_outside_vocab():
    with pytest.raises(ValueError, match=r"outside the tokenizer vocabulary: \['@'\]"):
        CharTokenizer()(["mail me @ home"])
    with pytest.raises(ValueError, match="outside"):
        CharTokenizer()(["日本"])


def test_tokenizer_rejects_bad_argument_types():
    with pytest.raises(TypeError, match="texts"):
        CharTokenizer()("a single string")
    with pytest.raises(ValueError, match="texts"):
        CharTokenizer()([])


def test_tokenizer_save_load(tmp_path):
    tok = CharTokenizer()
    loaded = CharTokenizer.load(tok.save(tmp_path / "tok.json"))
    assert torch.equal(loaded(["hello, world"]), tok(["hello, world"]))
    with pytest.raises(FileNotFoundError, match="path"):
        CharTokenizer.load(tmp_path / "missing.json")
