"""tools/compile_cache.py: torch.compile's cache folder packed on one machine and unpacked on another."""

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def cc():
    return load_script("tools/compile_cache.py")


def fill(root: Path, sizes: dict[str, int]) -> None:
    """Files of random (incompressible) bytes, written in the given order, one second apart in mtime."""
    for i, (name, size) in enumerate(sizes.items()):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
        os.utime(path, (1_000_000 + i, 1_000_000 + i))


def test_save_then_load_gives_the_same_files(cc, tmp_path):
    src, dst, out = tmp_path / "src", tmp_path / "dst", tmp_path / "out"
    fill(src, {"fxgraph/ab/entry": 3000, "triton/0/KEY/kernel.cubin": 2000, "aotautograd/x": 100})
    archive = cc.save(out, root=src)
    assert archive == out / cc.ARCHIVE and not list(out.glob("*.tmp"))
    assert cc.load(archive, root=dst) == 3
    for f in src.rglob("*"):
        if f.is_file():
            assert (dst / f.relative_to(src)).read_bytes() == f.read_bytes()


def test_save_keeps_the_newest_files_within_the_limit(cc, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    fill(src, {f"old/{i}": 4000 for i in range(6)} | {"new/a": 4000, "new/b": 4000})
    archive = cc.save(tmp_path / "out", root=src, max_bytes=10_000)
    assert archive.stat().st_size <= 10_000
    cc.load(archive, root=dst)
    kept = {str(f.relative_to(dst)) for f in dst.rglob("*") if f.is_file()}
    assert kept == {"new/a", "new/b"}  # the last written two; a third would not fit


def test_a_file_too_large_is_left_out_and_older_ones_still_go(cc, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    fill(src, {"old/small": 2000, "newer/huge": 50_000, "newest/small": 2000})
    cc.load(cc.save(tmp_path / "out", root=src, max_bytes=10_000), root=dst)
    assert {str(f.relative_to(dst)) for f in dst.rglob("*") if f.is_file()} == {"old/small", "newest/small"}


def test_nothing_to_save_writes_nothing(cc, tmp_path):
    (tmp_path / "empty").mkdir()
    assert cc.save(tmp_path / "out", root=tmp_path / "empty") is None
    fill(tmp_path / "big", {"one": 50_000})
    assert cc.save(tmp_path / "out", root=tmp_path / "big", max_bytes=1000) is None
    assert not (tmp_path / "out").exists()


def test_a_missing_archive_loads_nothing(cc, tmp_path):
    assert cc.load(tmp_path / "none.tar.gz", root=tmp_path / "dst") == 0


def test_load_refuses_members_outside_the_cache(cc, tmp_path):
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        data = b"x"
        info = tarfile.TarInfo("../escaped")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(tarfile.OutsideDestinationError):
        cc.load(archive, root=tmp_path / "dst")
    assert not (tmp_path / "escaped").exists()


INDUCTOR = """
import torch
from torch._dynamo.utils import counters
f = torch.compile(lambda x: (x.sin() * 2 + 1).sum(dim=-1), backend="inductor")
f(torch.randn(8, 8))
print("hits", counters["inductor"]["fxgraph_cache_hit"], "misses", counters["inductor"]["fxgraph_cache_miss"])
"""


def test_a_second_machine_compiles_from_the_archive(cc, tmp_path):
    """Inductor on the CPU: a process with an empty cache folder compiles (a miss), saves; a process on
    another folder, the archive loaded into it, finds the graph there (a hit)."""
    def compile_in(folder: Path) -> str:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(folder), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
        return subprocess.run([sys.executable, "-c", INDUCTOR], env=env, capture_output=True, text=True,
                              check=True).stdout.split()

    first = compile_in(tmp_path / "a")
    assert first[first.index("misses") + 1] == "1"
    archive = cc.save(tmp_path / "out", root=tmp_path / "a")
    cc.load(archive, root=tmp_path / "b")
    second = compile_in(tmp_path / "b")
    assert second[second.index("hits") + 1] == "1" and second[second.index("misses") + 1] == "0"
