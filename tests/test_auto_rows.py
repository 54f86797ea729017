"""tools/auto_rows.py on a small batch: its timing wrapper changes nothing decoded (greedy: every mode keeps
the same tokens), and every row count of the batch is reported (its timings are not tested)."""

import json

from conftest import load_script

auto_rows = load_script("tools/auto_rows.py")


def test_rows_table_counts_every_kept_token(tmp_path):
    from tts_specdec import api

    out = tmp_path / "rows.json"
    policy = api.SamplingPolicy
    auto_rows.main(["--widen", "0", "--batch", "2", "--sentences", "4", "--reps", "1", "--gammas", "0", "3",
                    "--temperature", "0", "--threads", "1", "--json", str(out)])
    assert api.SamplingPolicy is policy  # the wrapper is removed again
    report = json.loads(out.read_text())
    assert [row["rows"] for row in report["rows"]] == [2, 1]
    modes = ["gamma 0", "gamma 3", "auto"]
    kept = {m: sum(row[m]["tokens"] for row in report["rows"]) for m in modes}
    # greedy: the same tokens in every mode, so the same count kept (each row's EOS included)
    assert len(set(kept.values())) == 1 and kept["auto"] > 0
    # what was kept is what was generated, plus at most one EOS a row
    for m in modes:
        assert 0 <= kept[m] - report["generated_tokens"][m] <= 4
    assert report["rows"][0]["auto_arms"]  # auto's arms at two rows are listed


def test_rejects_a_negative_gamma():
    import pytest

    with pytest.raises(SystemExit):
        auto_rows.main(["--gammas", "-1"])
