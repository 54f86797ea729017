import time

import pytest
import torch

from tts_specdec.results import DecodeStats
from tts_specdec.timing import PhaseClock


def test_cpu_clock_sums_each_phase_and_starts_over():
    clock, stats = PhaseClock(torch.device("cpu")), DecodeStats()
    a = clock.mark()
    time.sleep(0.02)
    b = clock.mark()
    time.sleep(0.01)
    c = clock.mark()
    clock.add("draft", a, b)
    clock.add("verify", b, c)
    clock.add("verify", a, b)
    clock.into(stats)
    assert 0.02 <= stats.draft_time < 0.2
    assert stats.verify_time >= 0.03 and stats.verify_time > stats.draft_time
    clock.into(stats)  # nothing new: the sums were handed over
    assert stats.verify_time < 0.3 and stats.draft_time < 0.2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_clock_times_queued_work_not_the_host():
    clock, stats = PhaseClock(torch.device("cuda")), DecodeStats()
    x = torch.randn(4096, 4096, device="cuda")
    x = x @ x / 64  # the first product initialises cuBLAS on the host: keep it out of the timed part
    torch.cuda.synchronize()
    a = clock.mark()
    host_start = time.perf_counter()
    for _ in range(20):
        x = x @ x / 64  # queued: the host returns long before the device is done
    host_s = time.perf_counter() - host_start
    b = clock.mark()
    clock.add("verify", a, b)
    clock.into(stats)  # waits for the device
    assert stats.draft_time == 0
    # 20 fp32 products of 4096^3 take tens of ms on any GPU; queueing them takes far less
    assert stats.verify_time > max(1e-3, 2 * host_s), (stats.verify_time, host_s)
