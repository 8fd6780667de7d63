"""Files chunkflow reads and writes: read with the file named in every error; write atomically (a temporary file
in the same directory, then a rename), so an interrupted command never leaves half a file; check where an output
goes before any work."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

from chunkflow_planner.errors import ChunkflowError


class FileError(ChunkflowError):
    """A file that cannot be read or written where it was asked to be."""


def existing_file(path: str | Path, what: str) -> Path:
    """`path` as a Path, checked to be a file that exists ("what" names it in errors: "plan file", "video")."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileError(f"{what} {str(p)!r} does not exist")
    if p.is_dir():
        raise FileError(f"{what} {str(p)!r} is a directory; give the path of the file")
    return p


def read_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of the file at `path` ("what" names it in errors: "plan file", "hardware profile")."""
    p = existing_file(path, what)
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise FileError(f"{what} {str(p)!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise FileError(f"{what} {str(p)!r} cannot be read: {exc.strerror or exc}") from None


def check_output_file(path: str | Path, what: str) -> Path:
    """Where a file will be written, checked before any work: its directory exists and is writable, and the path
    is not a directory."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise FileError(f"{what} {str(p)!r} is a directory; give a file name (e.g. {str(p / 'out.json')!r})")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise FileError(f"{what} {str(p)!r}: directory {str(parent)!r} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise FileError(f"{what} {str(p)!r}: directory {str(parent)!r} is not writable")
    return p


def check_output_dir(path: str | Path, what: str) -> Path:
    """Where a directory of outputs will be created or filled, checked before any work."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise FileError(f"{what} {str(p)!r} is a file; give a directory (it is created if missing)")
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise FileError(f"{what} {str(p)!r}: {str(existing)!r} is not a writable directory")
    return p


def file_mode(path: Path) -> int:
    """The permissions a file written at `path` should get: the existing file's, else what open() would give
    (0666 less the umask), not the 0600 of a temporary file."""
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path: str | Path, suffix: str = ".tmp") -> Iterator[str]:
    """Within: the name of an empty temporary file beside `path` for the caller to write. On a normal exit it is
    flushed to disk, given the permissions an ordinary write would give and renamed over `path`; on an error it is
    removed and `path` is untouched. `suffix` lets a tool that goes by it (ffmpeg, OpenCV) see the format."""
    p = Path(path).expanduser()
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=suffix, dir=p.parent if str(p.parent) else ".")
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, file_mode(p))
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write `data` to `path` whole or not at all (`atomic_path`)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path).expanduser()
