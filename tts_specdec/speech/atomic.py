"""Files that appear complete or not at all: written under a temporary name, fsync'd, renamed."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator

TEMP_SUFFIX = ".partial"  # unfinished writes: `.<name>.<random>.partial` beside the target


def _file_mode() -> int:
    """The mode open() would give a new file (mkstemp's own is 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


FILE_MODE = _file_mode()


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "wb", encoding: str | None = None) -> Iterator[IO]:
    """Open a temporary file beside `path`; on a clean exit it replaces `path` (os.replace is atomic
    within a folder), on an exception or a kill `path` is untouched (the temporary file is removed,
    or after a kill left as `.<name>.*.partial`, which `remove_partials` clears)."""
    path = Path(path)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, mode, encoding=encoding) as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temp, FILE_MODE)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> None:
    """`text` (UTF-8) at `path`, atomically (`atomic_file`): a reader never sees half a file."""
    with atomic_file(path, "w", encoding="utf-8") as file:
        file.write(text)


def write_json(path: str | Path, value: object, indent: int = 1) -> None:
    """`value` as JSON at `path`, atomically (`write_text`): what the tools and recipes write results with."""
    write_text(path, json.dumps(value, indent=indent) + "\n")


def remove_partials(folder: str | Path) -> int:
    """Delete temporary files a killed writer left in `folder`; returns how many."""
    removed = 0
    for temp in Path(folder).glob(f".*{TEMP_SUFFIX}"):
        temp.unlink(missing_ok=True)
        removed += 1
    return removed


def discard(path: str | Path) -> bool:
    """Remove the file `path` if there is one (a symbolic link itself, never what it points to; never a
    folder): one unlink, atomic, so a reader sees the file or nothing. Returns whether one was removed."""
    path = Path(path)
    if not (path.is_symlink() or path.is_file()):
        return False
    path.unlink(missing_ok=True)
    return True
