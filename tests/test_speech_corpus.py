"""LJSpeech-layout metadata parsing and the corpus folder (no espeak-ng needed)."""

import pytest
import torch

from tts_specdec.speech.audio import read_wav, write_wav
from tts_specdec.speech.corpus import Utterance, parse_metadata, read_metadata, wav_path, write_metadata


def test_parse_two_and_three_fields():
    lines = ["a1|Hello there.", "", "LJ001-0002|In 1878, he said|In eighteen seventy eight, he said\n"]
    assert parse_metadata(lines) == [Utterance("a1", "Hello there."),
                                     Utterance("LJ001-0002", "In eighteen seventy eight, he said")]


@pytest.mark.parametrize("line", ["no separator", "a|b|c|d", "|text", "id|  "])
def test_parse_rejects_malformed_lines(line):
    with pytest.raises(ValueError, match="line 1"):
        parse_metadata([line])


def test_parse_rejects_duplicate_ids():
    with pytest.raises(ValueError, match="duplicate"):
        parse_metadata(["a|x", "a|y"])


def test_write_read_round_trip(tmp_path):
    utterances = [Utterance("u0", "Is the cat red?"), Utterance("u1", "It took 12 days!")]
    write_metadata(tmp_path, utterances)
    assert read_metadata(tmp_path) == utterances
    with pytest.raises(ValueError, match="u2"):
        write_metadata(tmp_path, [Utterance("u2", "a|b")])


def test_missing_files_raise_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="metadata.csv"):
        read_metadata(tmp_path)
    with pytest.raises(FileNotFoundError, match="path"):
        read_wav(wav_path(tmp_path, "nope"))


def test_wav_io_resamples_to_16k(tmp_path):
    wav = torch.sin(torch.arange(22050) / 10.0) * 0.5
    write_wav(tmp_path / "x.wav", wav, sample_rate=22050)
    back = read_wav(tmp_path / "x.wav")
    assert abs(back.numel() - 16000) <= 1
    with pytest.raises(ValueError, match="wav"):
        write_wav(tmp_path / "y.wav", torch.zeros(2, 10))
