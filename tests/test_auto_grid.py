"""tools/auto_grid.py's bookkeeping: the ratios each cell reports, the interleaved passes, the token check
and its refusals of bad arguments (the timings themselves are not tested)."""

import random
import re
import statistics
from types import SimpleNamespace

import pytest
import torch

from tts_specdec.results import DecodeStats
from conftest import load_script

auto_grid = load_script("tools/auto_grid.py")


def scripted(name: str, tokens: list[int], order: list[str], out=None) -> auto_grid.Mode:
    """A mode that records when it ran and returns `tokens` (its emitted tokens' lists)."""
    def run(rep):
        order.append(name)
        return 10, DecodeStats(gamma_hist=[2, 1]), tokens if out is None else out.pop(0)
    return auto_grid.Mode(name, [run])


def test_passes_interleave_and_the_warm_up_is_not_timed():
    order = []
    modes = [scripted(n, [[1, 2]], order) for n in ("plain", "fixed", "auto")]
    assert auto_grid.measure(modes, 3)
    assert order == ["plain", "fixed", "auto", "fixed", "auto", "plain", "auto", "plain", "fixed",
                     "plain", "fixed", "auto"]
    assert all(len(m.times) == 3 and m.tokens == [10] * 3 for m in modes)
    assert modes[2].gamma_hist == [6, 3]  # summed over the timed passes


def test_batches_interleave_call_by_call():
    """With several batches a pass runs each batch in every mode before the next batch, the order rotating
    from batch to batch; a mode's pass sums its calls."""
    order = []

    def mode(name):
        def call(i):
            def run(rep):
                order.append((name, i))
                return 10 + i, DecodeStats(gamma_hist=[i]), [[i]]
            return run
        return auto_grid.Mode(name, [call(0), call(1)])

    modes = [mode(n) for n in ("plain", "fixed", "auto")]
    assert auto_grid.measure(modes, 3)
    assert order[:6] == [("plain", 0), ("fixed", 0), ("auto", 0), ("fixed", 1), ("auto", 1), ("plain", 1)]
    assert order[6:9] == [("fixed", 0), ("auto", 0), ("plain", 0)]
    assert all(m.tokens == [21] * 3 and m.gamma_hist == [3] for m in modes)


def test_sampling_draws_a_seed_per_batch_and_pass_the_same_in_every_mode():
    """Each pass samples other draws (a seed kept across passes froze the fixed gamma's draws while auto's
    moved), and within a pass every mode draws with the same seed for the same batch."""
    seeds = []

    class Fake:
        def sample(self, source, generator=None, **kw):
            seeds.append((kw["gamma"], source, generator.initial_seed()))
            return SimpleNamespace(stats=DecodeStats(generated_tokens=1), tokens=[torch.tensor([1])])

    inputs = [("batch0", 8), ("batch1", 8)]
    modes = auto_grid.modes(Fake(), "sample", inputs, seed=7)
    assert auto_grid.measure(modes, 3)
    by_pass = [seeds[k:k + 6] for k in range(0, len(seeds), 6)]
    assert len(by_pass) == 4  # the warm-up and three timed passes
    for rep, calls in enumerate(by_pass):
        for gamma, source, seed in calls:
            assert seed == 7 + rep * 2 + (source == "batch1")
    assert len({seed for _, _, seed in seeds}) == 8  # every batch of every pass its own


def test_other_tokens_than_plain_are_found():
    order = []
    modes = [scripted("plain", [[1, 2]], order), scripted("fixed", [[1, 2]], order),
             scripted("auto", None, order, out=[[[1, 2]], [[1, 2]], [[1, 3]], [[1, 2]]])]
    assert not auto_grid.measure(modes, 3)


def test_cell_ratios():
    modes = [auto_grid.Mode(n, None, times=[1.0, 2.0, 1.0], tokens=[t, 2 * t, t])
             for n, t in (("plain", 100), ("fixed", 150), ("auto", 140))]
    cell = auto_grid.cell_result("shipped", 1, 2, "greedy", modes, True)
    assert cell["tokens_per_s"] == {"plain": 100, "fixed": 150, "auto": 140}
    assert cell["auto_vs_plain"] == pytest.approx(1.4) and cell["auto_vs_best"] == pytest.approx(140 / 150)
    assert cell["fixed_vs_plain"] == pytest.approx(1.5) and cell["per_pass_auto_vs_plain"] == pytest.approx([1.4] * 3)
    assert cell["per_pass_auto_vs_best"] == pytest.approx([140 / 150] * 3)
    assert cell["auto_vs_best_interval"] == pytest.approx([140 / 150] * 2)  # the passes agree: no spread
    assert "| shipped | 1 | 2 | greedy | 100.0 | 1.50 | 1.40 | 0.93 | 0.93-0.93 | 0.93-0.93 |" in auto_grid.table([cell])
    modes[2].times = [1.0, 2.0, 1.4]  # a slow third pass: the median holds, the range shows it
    spread = auto_grid.cell_result("shipped", 1, 2, "greedy", modes, True)
    assert spread["auto_vs_best"] == pytest.approx(140 / 150)
    assert "| 0.93 | 0.67-0.93 | 0.67-0.93 |" in auto_grid.table([spread])
    assert auto_grid.cell_result("shipped", 1, 2, "sample", modes, False)["same_tokens"] is None  # sampled: no check


def test_the_interval_is_a_bootstrap_over_passes_with_the_modes_paired():
    """Passes drawn with replacement, a pass's modes together: where auto is 0.95 of plain in every pass
    while whole passes move by 2x (load), the interval is 0.95 exactly; where auto's own speed scatters
    around plain's it is wide and holds the cell's ratio; the same passes give the same interval."""
    load = [1.0, 2.0, 0.5, 1.5, 1.2, 0.8, 1.1, 0.9, 1.7, 0.6, 1.3, 1.0, 0.7, 1.4, 1.05]
    paired = {"plain": [100 * x for x in load], "fixed": [80 * x for x in load], "auto": [95 * x for x in load]}
    assert auto_grid.interval(paired) == pytest.approx((0.95, 0.95))
    rng = random.Random(1)
    scattered = {"plain": [100.0] * 15, "fixed": [80.0] * 15, "auto": [100 * rng.uniform(0.85, 1.1) for _ in range(15)]}
    lo, hi = auto_grid.interval(scattered)
    assert lo < statistics.median(scattered["auto"]) / 100 < hi and hi - lo > 0.03
    assert auto_grid.interval(scattered) == (lo, hi)


def test_the_verdict_counts_cells_below_the_line_only_where_the_interval_is():
    cells = [dict(model="shipped", threads=1, batch=b, family="sample", auto_vs_best_interval=iv)
             for b, iv in ((2, [0.90, 0.96]), (4, [0.93, 0.99]), (8, [0.97, 1.02]))]
    assert auto_grid.verdict(cells) == ("auto / best against 0.97: 1 cells below it for sure (shipped 1t b2 sample), "
                                        "1 undecided by the passes, 1 at or above it (90% intervals)")


@pytest.mark.parametrize("args, match", [
    (["--reps", "2"], "--reps must be >= 3"),
    (["--batches", "0", "2"], r"--batches must be >= 1, got \[0\]"),
    (["--threads", "-1"], r"--threads must be >= 1"),
    (["--sentences", "0"], "--sentences must be >= 1"),
    (["--models", "huge"], "--models: invalid choice"),
])
def test_bad_arguments_are_refused_by_name(capsys, args, match):
    with pytest.raises(SystemExit):
        auto_grid.main(args)
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.parametrize("family", ["sample", "greedy", "beam"])
def test_a_null_grid_runs_the_auto_column_with_gamma_0(family):
    """`--null` (an A/A grid): the auto column asks for plain decoding's work, the others are unchanged."""
    asked = []

    class Fake:
        def sample(self, source, **kw):
            asked.append(kw["gamma"])
            return SimpleNamespace(stats=DecodeStats(generated_tokens=1), tokens=[torch.tensor([1])])

        beam_search = sample

    for null in (False, True):
        asked.clear()
        modes = auto_grid.modes(Fake(), family, [("batch0", 8)], seed=0, null=null)
        assert [m.name for m in modes] == ["plain", "fixed", "auto"]
        for m in modes:
            m.calls[0](1)
        fixed = auto_grid.BEAM_GAMMA if family == "beam" else auto_grid.FIXED_GAMMA
        assert asked == [0, fixed, 0 if null else "auto"]
