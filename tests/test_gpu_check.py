"""tools/gpu_check.py's table from benchmark reports (the GPU runs themselves need a GPU)."""

from pathlib import Path

import pytest

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("tools/gpu_check.py")


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


def test_recorded_runs_get_their_own_columns(gpu_check, capsys):
    """The recorded stage (TTS_SPECDEC_RECORD_RUNS=1) is tabled beside the compiled one."""
    lines = gpu_check.table({"shipped": {"compiled": report(4.0), "recorded": report(5.0)}})
    assert [ln["recorded_tokens_per_s"] / ln["compiled_tokens_per_s"] for ln in lines[1:]] == [1.25, 1.25]
    assert "recorded_tokens_per_s" not in lines[0]  # spear-tts's own rows are never compiled
    gpu_check.print_table(lines, "test device")
    assert "recorded" in capsys.readouterr().out


def test_cublas_products_get_their_own_columns(gpu_check, capsys):
    """The blas stages (TTS_SPECDEC_PRODUCTS=blas: cuBLAS's products against the default's reduction
    kernels) run with that setting and are tabled beside the compiled one."""
    lines = gpu_check.table({"width1024": {"compiled": report(4.0), "blas": report(2.0)}})
    assert [ln["blas_tokens_per_s"] / ln["compiled_tokens_per_s"] for ln in lines[1:]] == [0.5, 0.5]
    gpu_check.print_table(lines, "test device")
    assert "blas" in capsys.readouterr().out
    assert "width1024/blas" in gpu_check.STAGES and "shipped/blas" in gpu_check.OPTIONAL


def test_without_cuda_it_says_so(gpu_check, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_stages_run_in_order_within_the_budget(gpu_check, monkeypatch, tmp_path):
    """Stages start only while the run is younger than the budget; a failed stage is kept as an error and
    the others' results stay; the JSON holds what ran (the commands are faked: each takes 100 s)."""
    import json
    import torch

    clock = [0.0]
    calls = []

    def fake_run(cmd, timeout):
        calls.append((cmd, timeout))
        clock[0] += 100.0
        if "--json" in cmd:
            if "--compile" not in cmd and "--widen" not in cmd:
                return 1  # the shipped eager benchmark fails
            Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(report(4.0 if "--compile" in cmd else 1.0)))
        return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    monkeypatch.setattr(gpu_check.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(gpu_check, "run", fake_run)
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--budget", "350", "--out", str(out)]) == 1
    result = json.loads(out.read_text())
    assert [c[1] for c in calls] == [350, 250, 150, 50]  # each stage stopped at what is left of the budget
    assert "TTS_SPECDEC_RECORD_RUNS=1" in calls[1][0] and "--compile" in calls[1][0]  # recorded runs second
    assert "-m" in calls[3][0] and "cuda" in calls[3][0]  # the fourth stage: the CUDA tests
    assert result["skipped"] == ["width1024/compiled", "width1024/blas", "width1024/eager"]  # exactness: 0 sentences
    assert result["errors"] == {"shipped/eager": "exit status 1"} and result["pytest_cuda_rc"] == 0
    assert list(result["runs"]) == ["shipped"] and list(result["runs"]["shipped"]) == ["compiled", "recorded"]
    assert [line["compiled_tokens_per_s"] for line in result["table"][1:]] == [800.0, 2000.0]
    assert not list(tmp_path.glob("gpu.*.json"))  # each run's own JSON was folded in


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


def test_gpu_profile_sorts_kernels_into_classes_per_token():
    """tools/gpu_profile.py's kernel classes from a profile's key averages (names as an H100 profile gave
    them): launches and device microseconds per token; a compiled graph's own event and host-only events
    are left out."""
    from types import SimpleNamespace as Event

    module = load_script("tools/gpu_profile.py")
    events = [Event(key="sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize32x32x8", count=20, self_device_time_total=160.0),
              Event(key="void gemvNSP_kernel<float, float, float, float, 1, 32>", count=10, self_device_time_total=20.0),
              Event(key="void cublasLt::splitKreduce_kernel<32, 16, int, float>", count=30, self_device_time_total=45.0),
              Event(key="triton_per_fused__softmax_add_arange_0", count=8, self_device_time_total=12.0),
              Event(key="triton_tem_fused_mm_0", count=2, self_device_time_total=6.0),
              Event(key="void at::native::reduce_kernel<512, 1>", count=2, self_device_time_total=2.0),
              Event(key="Memcpy DtoD (Device -> Device)", count=4, self_device_time_total=4.0),
              Event(key="void at::native::vectorized_elementwise_kernel<4>", count=2, self_device_time_total=2.0),
              Event(key="## Call CompiledFxGraph fabc", count=1, self_device_time_total=0.0),
              Event(key="cudaGraphLaunch", count=5, self_device_time_total=0.0)]
    out = module.kernel_classes(events, tokens=2)
    assert out == {"gemm": {"launches": 16.0, "device_us": 93.0}, "split-K reduce": {"launches": 15.0, "device_us": 22.5},
                   "fused (triton)": {"launches": 4.0, "device_us": 6.0}, "copy/set": {"launches": 2.0, "device_us": 2.0},
                   "other": {"launches": 2.0, "device_us": 2.0}}
