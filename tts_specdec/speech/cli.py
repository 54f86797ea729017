"""Command lines that answer a user's mistake with one line and exit status 2, not a traceback.

Mistakes are what the user can fix by changing the command: a missing or unreadable file, a folder
that cannot be written, a number out of range, a checkpoint that does not load. Anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator, NoReturn

USAGE_ERROR = 2
# what loading files and checking values raise for a user's mistake (UnicodeDecodeError is a ValueError)
USER_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, ValueError)


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (`prog: error: message`) without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


def fail(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(USAGE_ERROR)


@contextlib.contextmanager
def user_errors(prog: str) -> Iterator[None]:
    """Turn a user's mistake raised inside into one line on stderr and exit status 2."""
    try:
        yield
    except USER_ERRORS as error:
        fail(prog, str(error).splitlines()[0] if str(error) else type(error).__name__)


def int_at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: an integer >= minimum."""
    return int_in(minimum)


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """argparse type: an integer in [low, high] (high None: no upper bound)."""
    bound = f">= {low}" if high is None else f"in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {value}")
        return value
    return parse


def float_in(low: float, high: float = math.inf) -> Callable[[str], float]:
    """argparse type: a finite number in [low, high]."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and low <= value <= high):
            bound = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text!r}")
        return value
    return parse


def readable_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{what}: no such file: {path}")
    if not os.access(path, os.R_OK):
        raise PermissionError(f"{what}: cannot read {path}")
    return path


def writable_folder(path: Path, what: str) -> Path:
    """Create `path` if needed and prove a file can be written there, before any work is done."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except FileExistsError:
        raise NotADirectoryError(f"{what}: {path} exists and is not a folder") from None
    except OSError as error:
        raise PermissionError(f"{what}: cannot write into {path} ({error.strerror or error})") from None
    return path
