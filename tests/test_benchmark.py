"""recipes/benchmark.py's bounds: Leviathan et al.'s expected improvement and its verify-cost form."""

import pytest

from tts_specdec.results import DecodeStats
from conftest import load_script

benchmark = load_script("recipes/benchmark.py")


def test_bound_is_leviathans_closed_form_at_unit_verify_cost():
    alpha, gamma, c = 0.8, 4, 0.25
    expected = (1 - alpha**5) / ((1 - alpha) * (gamma * c + 1))
    assert benchmark.leviathan_bound(alpha, gamma, c) == pytest.approx(expected, rel=1e-12)
    assert benchmark.leviathan_bound(alpha, gamma, c, 1.0) == pytest.approx(expected, rel=1e-12)


def test_bound_extremes_and_verify_cost():
    # every draft accepted: gamma + 1 tokens per cycle; none: one token per cycle
    assert benchmark.leviathan_bound(1.0, 4, 0.25, 3.0) == pytest.approx(5 / 4.0)
    assert benchmark.leviathan_bound(0.0, 4, 0.25, 3.0) == pytest.approx(1 / 4.0)
    # the bound is continuous at alpha -> 1 and scales as 1 / (gamma c + v)
    assert benchmark.leviathan_bound(1 - 1e-9, 6, 0.1) == pytest.approx(benchmark.leviathan_bound(1.0, 6, 0.1), rel=1e-6)
    assert benchmark.leviathan_bound(0.9, 3, 0.2, 2.6) == pytest.approx(
        benchmark.leviathan_bound(0.9, 3, 0.2) * 1.6 / 3.2, rel=1e-12)


@pytest.mark.parametrize("alpha", [-0.1, 1.5])
def test_bound_rejects_alpha_outside_unit_interval(alpha):
    with pytest.raises(ValueError, match="alpha"):
        benchmark.leviathan_bound(alpha, 4, 0.2)


def test_verify_ratio_is_verify_time_per_pass_over_a_plain_step():
    stats = DecodeStats(target_passes=10, verify_time=0.03)
    assert benchmark.verify_ratio(stats, 0.001) == pytest.approx(3.0)
    assert benchmark.verify_ratio(stats, None) is None
    assert benchmark.verify_ratio(DecodeStats(), 0.001) is None


@pytest.mark.parametrize("mode, family", [
    ("spear-tts generate (sampling)", "sample"), ("ours sample", "sample"),
    ("ours auto sample (gamma=auto)", "sample"), ("ours speculative sample (gamma<=10, conf 0.9)", "sample"),
    ("ours greedy", "greedy"), ("ours speculative greedy (gamma=4)", "greedy"), ("ours auto greedy (gamma=auto)", "greedy"),
    ("spear-tts generate (beam 4)", "beam"), ("ours auto beam (beam 4, gamma=auto)", "beam"),
    ("ours speculative beam (beam 4, gamma=1, W=8)", "beam"), ("drop-in generate(beam 4, spec, gamma=1, W=8)", "beam"),
])
def test_rows_fall_into_their_plain_modes_family(mode, family):
    """--families keeps each row with its baseline: a family filter never leaves a ratio without its base."""
    assert benchmark.family(mode) == family


@pytest.mark.parametrize("args, message", [
    (["--beam-size", "1000000"], "argument --beam-size: must be an integer in [1, 1024], got 1000000"),
    (["--gamma", "1000000"], "argument --gamma: must be an integer in [0, 256], got 1000000"),
    (["--beam-gamma", "1", "1000000000"], "argument --beam-gamma: must be an integer in [1, 256], got 1000000000"),
])
def test_absurd_sizes_are_one_line_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit:
        benchmark.main(args)
    err = capsys.readouterr().err  # "prog: error: ...": prog is the script's name (here pytest's)
    assert exit.value.code == 2 and err.endswith(f": error: {message}\n") and err.count("\n") == 1
