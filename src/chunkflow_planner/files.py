"""Files chunkflow reads and writes: read with the file named in every error; write atomically (a temporary file
in the same directory, then a rename), so an interrupted command never leaves half a file; check where an output
goes before any work."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Iterator

from chunkflow_planner.errors import ChunkflowError


class FileError(ChunkflowError):
    """A file that cannot be read or written where it was asked to be."""


# The signal (SIGINT 2, SIGTERM 15) that interrupted this command, if one did (chunkflow.signals sets it): a write
# finished after it is not committed, so an interrupted command never leaves an output that looks complete.
_INTERRUPTED: dict[str, int | None] = {"signal": None}


def note_interrupt(signum: int | None) -> None:
    """Remember the signal that interrupted this command (None: forget it, as a new command starts)."""
    _INTERRUPTED["signal"] = signum


def interrupted() -> int | None:
    """The signal that interrupted this command, or None."""
    return _INTERRUPTED["signal"]


def _real(path: str | Path) -> str:
    return os.path.realpath(os.path.expanduser(str(path)))


def check_distinct(outputs: dict[str, str | Path | None], inputs: dict[str, str | Path | None]) -> None:
    """Before any work: every output (flag -> path) goes to a file of its own, and none over a file the command
    reads (an input file, or a file inside an input folder). Symlinks and relative paths are resolved."""
    seen: dict[str, str] = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        real = _real(path)
        if real in seen:
            raise FileError(f"{flag} {str(path)!r} and {seen[real]} are the same file; give each output its own "
                            "path (nothing was written)")
        seen[real] = flag
        for what, given in inputs.items():
            if given is None:
                continue
            src = _real(given)
            if real == src:
                raise FileError(f"{flag} {str(path)!r} is the file {what} gives, which this command reads; write it "
                                "elsewhere (nothing was written)")
            if os.path.isdir(src) and real.startswith(src.rstrip(os.sep) + os.sep) and os.path.exists(real):
                raise FileError(f"{flag} {str(path)!r} would overwrite a file of {what} {str(given)!r}, which this "
                                "command reads; write it elsewhere (nothing was written)")


# The file system's limits on a name (one path component) and a whole path, in bytes (Linux's NAME_MAX and PATH_MAX;
# macOS and Windows allow no more). A folder's own file system may allow less: `_name_max` asks it.
NAME_MAX = 255
PATH_MAX = 4096
# C0 (tab and newline included), DEL, C1, the Unicode line and paragraph separators and the bidi controls: a file name
# holding one prints as something else than it is (a newline forges a line; an override reverses the text)
_CONTROL_IN_NAME = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def _shown(text: str, limit: int = 80) -> str:
    """`text` as an error shows it: its repr, cut to `limit` characters with its length said."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text):,} characters)"


def _name_max(p: Path) -> int:
    """The longest file name (bytes) the file system of `p`'s nearest existing folder takes (NAME_MAX if unknown)."""
    folder = p.parent
    for _ in range(64):
        try:
            if os.path.isdir(folder):
                return min(NAME_MAX, os.pathconf(folder, "PC_NAME_MAX"))
        except (OSError, ValueError):
            return NAME_MAX
        if folder == folder.parent:
            break
        folder = folder.parent
    return NAME_MAX


def check_path(path: str | Path, what: str, output: bool = False) -> Path:
    """`path` checked to be one a file system can look up, before anything touches it ("what" names it in errors:
    "--out", "--plan"): text without a NUL byte or an unencodable character, no name in it over the file system's
    NAME_MAX bytes (255, counted as the file system counts them, in UTF-8 bytes, not characters: 100 emoji are
    400), the whole under PATH_MAX. An output (`output`) may not hold control characters either (a newline, an
    escape sequence, a bidi override): it could not be shown, typed or listed as what it is. FileError says which
    and what to do; the message shows the path escaped and cut short."""
    text = os.fspath(path)
    if "\x00" in text:
        raise FileError(f"{what} {_shown(text)} holds a NUL byte, which no file name can; give the path without it")
    try:
        raw = os.fsencode(text)
    except UnicodeError:
        raise FileError(f"{what} {_shown(text)} holds characters a file name cannot be written in (a lone "
                        "surrogate); give a path of valid text") from None
    if output and (bad := _CONTROL_IN_NAME.search(text)):
        raise FileError(f"{what} {_shown(text)} holds a control character ({bad.group()!r} at character "
                        f"{bad.start() + 1}): a file of that name could not be shown or typed as it is; give a name "
                        "of printable characters (nothing was written)")
    if len(raw) >= PATH_MAX:
        raise FileError(f"{what} {_shown(text)} cannot be looked up: File name too long (the path is {len(raw):,} "
                        f"bytes, over the {PATH_MAX - 1:,} a path may have); give a shorter one")
    p = Path(text).expanduser()
    limit = _name_max(p)
    for part in p.parts:
        n = len(os.fsencode(part))
        if n > limit:
            chars = f"{len(part):,} characters, " if len(part) != n else ""
            raise FileError(f"{what} {_shown(text)} cannot be looked up: File name too long (its name "
                            f"{_shown(part, 40)} is {chars}{n:,} bytes, over the {limit} bytes a file name may have "
                            "on this file system); give a shorter name")
    return p


def not_there(p: Path) -> str:
    """Why an existing-looking path cannot be found: 'does not exist', or the folder on its way this user may not
    enter (a missing file and an unreachable one look the same to exists())."""
    for parent in [p.parent, *p.parent.parents]:
        if parent.exists():
            if not os.access(parent, os.X_OK):
                return f"cannot be reached: permission denied on its folder {str(parent)!r}"
            break
    return "does not exist"


def existing_file(path: str | Path, what: str) -> Path:
    """`path` as a Path, checked to be a file that exists ("what" names it in errors: "plan file", "video")."""
    p = check_path(path, what)
    if not p.exists():
        raise FileError(f"{what} {str(p)!r} {not_there(p)}")
    if p.is_dir():
        raise FileError(f"{what} {str(p)!r} is a directory; give the path of the file")
    return p


# Every file chunkflow reads as text (plans, hardware profiles, run reports, bench files) is far smaller than this:
# a plan or profile is tens of KB, a run report of MAX_STEPS steps about 20 MB. A larger file is not one of them.
MAX_TEXT_BYTES = 64 * 2**20

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str:
    """What a stat mode that is not a regular file is, in words ("a FIFO (named pipe)")."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_text(path: str | Path, what: str, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of the regular file at `path` ("what" names it in errors: "plan file", "hardware profile"),
    at most `max_bytes` long (read_bounded: a FIFO, device or socket is refused without reading it, and so is a
    longer file)."""
    p = existing_file(path, what)
    if not os.access(p, os.R_OK) and os.access(p.parent, os.X_OK) and p.is_file():
        raise FileError(f"{what} {str(p)!r} cannot be read: permission denied (it exists; check its permissions)")
    data = read_bounded(p, f"{what} {str(p)!r}", max_bytes,
                        fix=f"give the right file (no {what} chunkflow writes is over {max_bytes // 2**20} MiB)"
                        if max_bytes >= 2**20 else "give the right file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileError(f"{what} {str(p)!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def check_output_file(path: str | Path, what: str) -> Path:
    """Where a file will be written, checked before any work: its directory exists and is writable, and the path
    is a new name or a regular file (a directory, device, FIFO or socket there is refused: the write would replace
    it). A probe file is made and removed there, so that what only the write would find (a read-only or full file
    system, permissions os.access does not see) is found now."""
    p = check_path(path, what, output=True)
    if p.is_dir():
        raise FileError(f"{what} {str(p)!r} is a directory; give a file name (e.g. {str(p / 'out.json')!r})")
    _check_replaceable(p, what)
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise FileError(f"{what} {str(p)!r}: directory {str(parent)!r} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise FileError(f"{what} {str(p)!r}: directory {str(parent)!r} is not writable")
    _probe(parent, p, what)
    return p


def _probe(folder: Path, p: Path, what: str) -> None:
    """A file made in `folder` and removed: FileError where none can be (a read-only file system, no inode left).
    Under torchrun only rank 0 writes a command's outputs, so only it probes: a rank other than 0 writes nothing in
    the user's folders, not even a probe (the same RANK chunkflow.launch.torchrun_rank reads)."""
    if os.environ.get("RANK", "0").strip() not in ("", "0"):
        return
    try:
        fd, name = tempfile.mkstemp(prefix=".chunkflow-probe-", dir=folder)
    except OSError as exc:
        raise FileError(f"{what} {_shown(str(p))}: no file can be made in {_shown(str(folder))} "
                        f"({exc.strerror or exc}); give a folder you can write to (nothing was written)") from None
    os.close(fd)
    os.unlink(name)


def check_output_dir(path: str | Path, what: str) -> Path:
    """Where a directory of outputs will be created or filled, checked before any work."""
    p = check_path(path, what, output=True)
    if p.exists() and not p.is_dir():
        kind = "a file" if p.is_file() else file_kind(p.stat().st_mode)
        raise FileError(f"{what} {str(p)!r} is {kind}; give a directory (it is created if missing)")
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise FileError(f"{what} {str(p)!r}: {str(existing)!r} is not a writable directory")
    _probe(existing, p, what)
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


def _check_replaceable(p: Path, what: str) -> None:
    """`p` is a new name (a dangling link too) or a regular file (through links): what a rename may replace."""
    try:
        mode = os.stat(p).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise FileError(f"{what} {str(p)!r} is {file_kind(mode)}; an output is written as a regular file, and this "
                        "would replace it: give a new file name (nothing was written)")


@contextlib.contextmanager
def atomic_path(path: str | Path, suffix: str = ".tmp") -> Iterator[str]:
    """Within: the name of an empty temporary file beside `path` for the caller to write. On a normal exit it is
    flushed to disk, given the permissions an ordinary write would give and renamed over `path`; on an error it is
    removed and `path` is untouched. `suffix` lets a tool that goes by it (ffmpeg, OpenCV) see the format.

    `path` must be a new name or a regular file (checked before and again just before the rename). A write that
    fails (a full disk, a file size limit: an OSError within, or while flushing) is a FileError naming `path`."""
    p = Path(path).expanduser()
    _check_replaceable(p, "output")
    try:
        # the temporary name is the output's with 10 bytes and the suffix more: a name near NAME_MAX gets a short one
        prefix = f".{p.name}." if len(os.fsencode(p.name)) + 10 + len(suffix) + 8 <= NAME_MAX else ".chunkflow-"
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=p.parent if str(p.parent) else ".")
    except OSError as exc:
        raise _write_error(p, exc) from None
    os.close(fd)
    try:
        yield tmp
        if interrupted() is not None:  # finished after an interrupt (a tool that swallowed it): not committed
            raise KeyboardInterrupt
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, file_mode(p))
        _check_replaceable(p, "output")
        os.replace(tmp, p)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise _write_error(p, exc) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_error(p: Path, exc: OSError) -> FileError:
    """The error of a write to `p` that failed with `exc` (atomic_path leaves `p` as it was)."""
    hints = {errno.ENOSPC: "free some space or write it elsewhere",
             errno.EDQUOT: "free some of your quota or write it elsewhere",
             errno.EFBIG: "the file system or a limit on file size (ulimit -f) does not allow it; write it elsewhere",
             errno.EROFS: "the file system is read-only; write it elsewhere",
             errno.EACCES: "check the folder's permissions", errno.EPERM: "check the folder's permissions"}
    hint = hints.get(exc.errno, "check the disk and the folder, or write it elsewhere")
    return FileError(f"cannot write {str(p)!r}: {exc.strerror or exc}; it is left as it was ({hint})")


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write `data` to `path` whole or not at all (`atomic_path`)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path).expanduser()


def irregular_kind(mode: int) -> str | None:
    """What a file of `mode` is when it is not a regular file (file_kind; None for a regular file)."""
    return None if stat.S_ISREG(mode) else file_kind(mode)


def read_bounded(path: str | Path, what: str, limit: int, error: type[ChunkflowError] = FileError,
                 fix: str = "give the path of a regular file") -> bytes:
    """The bytes of the regular file at `path` (links followed), at most `limit` of them.

    A FIFO, a device, a socket or a directory is refused from its `stat` alone, before it is opened (a FIFO's open
    blocks until a writer comes, /dev/zero reads for ever, some devices act on an open). A file over `limit` bytes
    is refused by its size, and at most `limit` + 1 bytes are read whatever the size said (a file that grows, or
    one whose size is not its length). `what` names the file in errors ("model_index.json in '/models/wan'"), raised
    as `error` and ending with `fix`, what to do."""
    p = Path(path)
    try:
        kind = irregular_kind(os.stat(p).st_mode)
        if kind is None:
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0))
            try:
                st = os.fstat(fd)
                kind = irregular_kind(st.st_mode)  # replaced since the stat: checked on what was opened
                if kind is None and st.st_size <= limit:
                    with os.fdopen(os.dup(fd), "rb") as f:
                        data = f.read(limit + 1)
                    if len(data) <= limit:
                        return data
                size = st.st_size
            finally:
                os.close(fd)
    except OSError as exc:
        raise error(f"{what} cannot be read: {exc.strerror or exc}; {fix}") from None
    if kind is not None:
        raise error(f"{what} is {kind}, not a regular file, and is not read; {fix}")
    raise error(f"{what} is over {limit:,} bytes ({max(size, limit + 1):,}), more than such a file holds: it is "
                f"damaged or not what it claims to be, and is not read; {fix}")
