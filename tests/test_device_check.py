"""recipes/device_check.py on the CPU: the equivalences it repeats on a GPU, reported per dtype."""

import pytest

from conftest import load_script

pytestmark = pytest.mark.usefixtures("one_thread")


def test_each_dtype_is_checked_and_reported(capsys):
    """float32 and the model converted to bfloat16: every speculative mode equals its plain mode on the
    CPU (a half-precision model computes in float32 there), one verdict per dtype, exit status 0."""
    device_check = load_script("recipes/device_check.py")
    rc = device_check.main(["--device", "cpu", "--sentences", "2", "--batch", "2", "--beam-size", "2",
                            "--dtype", "float32", "bfloat16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "--- model in float32" in out and "--- model in bfloat16" in out
    assert "float32: all speculative modes equal their plain modes" in out
    assert "bfloat16: all speculative modes equal their plain modes" in out
