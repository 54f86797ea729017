"""tools/gpu_check.py's table from benchmark reports (the GPU runs themselves need a GPU)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report(scale: float) -> dict:
    return {"rows": [
        {"mode": "spear-tts generate (sampling)", "tokens_per_s": 100.0},
        {"mode": "ours sample", "tokens_per_s": 200.0 * scale, "vs": "spear-tts generate (sampling)", "speedup": 2.0 * scale},
        {"mode": "ours speculative sample (gamma=4)", "tokens_per_s": 500.0 * scale, "vs": "ours sample", "speedup": 2.5},
    ]}


def test_table_pairs_each_row_with_its_compiled_twin(gpu_check, capsys):
    runs = {setup: {"eager": report(1.0), "compiled": report(4.0)} for setup in gpu_check.SETUPS}
    lines = gpu_check.table(runs)
    assert len(lines) == 3 * len(gpu_check.SETUPS)
    upstream, plain, spec = lines[:3]
    assert "compiled_tokens_per_s" not in upstream  # spear-tts rows are never compiled
    assert plain["compiled_over_eager"] == pytest.approx(4.0) and spec["compiled_speedup"] == pytest.approx(2.5)
    gpu_check.print_table(lines, "test device")
    assert "ours speculative sample (gamma=4)" in capsys.readouterr().out


def test_without_cuda_it_says_so(gpu_check, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert gpu_check.main(["--skip-tests"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_benchmark_compile_flag_reaches_the_decoder(monkeypatch):
    """`recipes/benchmark.py --compile [BACKEND]` builds its rows on SpeculativeDecoder(compile=...)."""
    import sys

    sys.path.insert(0, str(ROOT / "recipes"))
    import benchmark

    seen = []
    real = benchmark.SpeculativeDecoder

    def spy(model, **kwargs):
        seen.append(kwargs.get("compile"))
        return real(model, **kwargs)

    def stop(modes, reps):  # the rows are built; nothing is timed
        raise SystemExit(0)

    monkeypatch.setattr(benchmark, "SpeculativeDecoder", spy)
    monkeypatch.setattr(benchmark, "measure", stop)
    for argv, expected in ((["--compile"], True), (["--compile", "aot_eager"], "aot_eager"), ([], False)):
        with pytest.raises(SystemExit):
            benchmark.main(["--distill-steps", "0", "--families", "greedy", "--skip-upstream", *argv])
        assert seen[-1] == expected
