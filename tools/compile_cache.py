"""torch.compile's on-disk caches carried from one GPU loan to the next: the inductor cache folder (compiled
graphs, Triton kernels, autotuning and automatic-dynamic records) packed into one archive that comes back
from the device machine, and unpacked there before the next loan compiles anything.

A lent GPU comes with minutes, and most of them went to compiling: on an H200 each mode's first call
compiled for 20-40 s (three settings of six modes took 483 s, of which the decodes were seconds), and
the CUDA tests' longest ran 355 s cold against 123 s with a warm cache (docs/gpu.md). torch keys every
entry by what it was built from (the graph, torch's version and config, the device), so an entry of
code that changed since is never used, only left unread.

    python3 tools/compile_cache.py save $OUT                          # after the runs: $OUT/compile-cache.tar.gz
    python3 tools/compile_cache.py load .gpu/compile-cache.tar.gz     # before them (`.gpu/setup.sh` does it)

`save` keeps the archive within --max-mb (16: the most one file may bring back from a device run),
taking the most recently written files first where the whole folder does not fit. `load` unpacks
only regular files and folders inside the cache folder (tarfile's "data" filter). Load only archives
your own runs made: torch unpickles its cache entries.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile
import zlib
from pathlib import Path

ARCHIVE = "compile-cache.tar.gz"


def cache_dir() -> Path:
    """The folder torch's inductor caches in: TORCHINDUCTOR_CACHE_DIR, else torch's default
    (/tmp/torchinductor_<user>); Triton's kernels go under it unless TRITON_CACHE_DIR says otherwise."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as torch_cache_dir

    return Path(torch_cache_dir())


def _pack(root: Path, files: list[Path]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for f in files:
            tar.add(f, arcname=str(f.relative_to(root)), recursive=False)
    return buf.getvalue()


def save(out_dir: Path, root: Path | None = None, max_bytes: int = 16 << 20) -> Path | None:
    """Packs `root` (default: `cache_dir()`) into out_dir/ARCHIVE, written atomically, at most `max_bytes`:
    where everything does not fit, the most recently written files first, each that still fits by its
    compressed size alone (then a tenth fewer while the archive does not). None where no file fits."""
    root = cache_dir() if root is None else root
    files = sorted((f for f in root.rglob("*") if f.is_file() and not f.is_symlink()),
                   key=lambda f: f.stat().st_mtime, reverse=True)
    kept, total = [], 0
    for f in files:  # newest first, each that still fits; a tar header (~1 KB) compresses to a few bytes
        # estimated at zlib's fastest level, which compresses less than the archive's: an estimate from above
        size = len(zlib.compress(f.read_bytes(), 1)) + 64
        if total + size <= max_bytes:
            kept.append(f)
            total += size
    data = _pack(root, kept) if kept else b""
    while len(data) > max_bytes and len(kept) > 1:  # the estimate was short: a tenth fewer, oldest out
        kept = kept[: len(kept) * 9 // 10]
        data = _pack(root, kept)
    count = len(kept)
    if not kept or len(data) > max_bytes:
        print(f"compile-cache: nothing saved ({len(files)} files in {root})", file=sys.stderr)
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ARCHIVE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    print(f"compile-cache: {count} of {len(files)} files, {len(data) / 1e6:.1f} MB -> {path}")
    return path


def load(archive: Path, root: Path | None = None) -> int:
    """Unpacks `archive` into `root` (default: `cache_dir()`); returns the files unpacked (0: no archive).
    Members that are not plain files or folders, or that would land outside `root`, are refused."""
    if not archive.is_file():
        print(f"compile-cache: no {archive}: compiling from scratch", file=sys.stderr)
        return 0
    root = cache_dir() if root is None else root
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, mode="r:gz") as tar:
        members = tar.getmembers()
        tar.extractall(root, filter="data")
    files = sum(m.isfile() for m in members)
    print(f"compile-cache: {files} files from {archive} -> {root}")
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("save", help="pack the cache folder into DIR/" + ARCHIVE)
    s.add_argument("dir", type=Path)
    s.add_argument("--max-mb", type=float, default=16.0)
    lo = sub.add_parser("load", help="unpack ARCHIVE into the cache folder")
    lo.add_argument("archive", type=Path)
    args = p.parse_args(argv)
    if args.verb == "save":
        save(args.dir, max_bytes=int(args.max_mb * (1 << 20)))
    else:
        load(args.archive)
    return 0


if __name__ == "__main__":
    sys.exit(main())
