"""tools/cost_model_load.py on the shipped model, quiet only: both statistics measured, the library's own
put back (its timings are not tested)."""

import json

import pytest

from conftest import load_script

cost_model_load = load_script("tools/cost_model_load.py")


def test_measures_with_both_statistics_and_restores_the_library(tmp_path):
    from tts_specdec import measure

    kept = measure.fastest
    out = tmp_path / "load.json"
    report = cost_model_load.main(["--widen", "0", "--reps", "1", "--busy", "0", "--threads", "1", "--json", str(out)])
    assert measure.fastest is kept
    assert json.loads(out.read_text()) == report
    assert set(report["measurements"]) == {"quiet, fastest", "quiet, median"}
    for (row,) in report["measurements"].values():
        assert row["step_ms"] > 0 and row["v5"] > 0 and 0 <= row["gamma_at_0.8"] <= row["gamma_at_1.0"]


def test_rejects_no_repetitions():
    with pytest.raises(SystemExit):
        cost_model_load.main(["--reps", "0"])
