"""Every file unimp writes: whole, or not at all.

Two writers, for the two kinds of file unimp makes:

- :func:`write_file` (policy files of ``unimp import/export/tune -o``, :meth:`Tuned.write`,
  :func:`unimp.policy.dump`, conformance observations): the text goes to a temporary file in the
  target's directory, is flushed to disk (``fsync``) and renamed over the target (``os.replace``,
  atomic). A reader sees the old file or the new one, never a part; a failure removes the
  temporary file and leaves the target as it was.
- :class:`AppendLog` (the watch's JSON lines): each record is one complete line appended with one
  ``write``; a write the disk cut short is truncated back, so the log never ends in half a line.

A target that is not a regular file (a FIFO, a device, a socket, a directory) is refused before
anything opens it (opening a FIFO for writing waits for a reader). Every failure is one
:class:`~unimp.errors.FileError` naming the file, the cause and the fix.

>>> import pathlib, tempfile
>>> path = pathlib.Path(tempfile.mkdtemp()) / "policy.toml"
>>> write_file(path, 'name = "p"\\n', where="-o")
False
>>> write_file(path, 'name = "q"\\n', where="-o"), path.read_text()
(True, 'name = "q"\\n')
>>> write_file(path.parent, "x", where="-o")  # doctest: +ELLIPSIS
Traceback (most recent call last):
unimp.errors.FileError: -o: is a directory; name a file in it (e.g. .../policy.toml)
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from unimp.errors import FileError
from unimp.text import printable

MAX_SHOWN = 200  # characters of a path quoted in a message

# what the common failures mean, and their fix
_CAUSES = {
    errno.ENOSPC: ("no space left on device", "free space or write elsewhere"),
    errno.EFBIG: ("file too large (the file size limit, `ulimit -f`)", "raise the limit or write elsewhere"),
    errno.EDQUOT: ("disk quota exceeded", "free space or write elsewhere"),
    errno.EROFS: ("read-only file system", "write elsewhere"),
    errno.EACCES: ("permission denied", "choose a writable file and directory"),
    errno.EPERM: ("operation not permitted", "choose a writable file and directory"),
}


def shown(path: Any) -> str:
    """A path as quoted in a message: escaped and bounded."""
    text = printable(os.fspath(path) if isinstance(path, str | os.PathLike) else repr(path))
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


def _path(path: Any, where: str) -> Path:
    if not isinstance(path, str | os.PathLike) or not os.fspath(path):
        raise FileError(f"{where}: expected a file name (a str or path), got {printable(repr(path)[:60])}")
    try:
        return Path(os.fspath(path))
    except TypeError:  # bytes paths
        raise FileError(f"{where}: expected a file name as text, got {printable(repr(path)[:60])}") from None


def target(path: Any, where: str, example: str = "policy.toml") -> Path:
    """The regular file ``path`` names (a link followed), checked before anything opens it: a
    directory, a FIFO, a device or a socket there, or a missing directory, is a :class:`FileError`."""
    p = _path(path, where)
    try:
        real = Path(os.path.realpath(p))
        st = os.stat(real)
    except FileNotFoundError:
        st = None
    except (OSError, ValueError) as e:
        raise FileError(f"{where}: cannot look at {shown(p)} ({getattr(e, 'strerror', None) or e}); "
                        f"name a writable file") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise FileError(f"{where}: is a directory; name a file in it (e.g. {shown(p / example)})")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise FileError(f"{where}: {shown(p)} is not a regular file (a FIFO, device or socket); unimp writes "
                        f"only regular files: name one")
    if not real.parent.is_dir():
        raise FileError(f"{where}: its directory {shown(p.parent)} does not exist; create it first or write "
                        f"elsewhere")
    return real


def _failed(where: str, path: Path, e: OSError, left: str) -> FileError:
    """One located error for a failed write: the cause, what was left, the fix."""
    what, fix = _CAUSES.get(e.errno or 0, (e.strerror or str(e), "choose another file"))  # errno None: no cause
    return FileError(f"{where}: {what} writing {shown(path)}; {left} ({fix})")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_file(path: Any, text: str | bytes, *, where: str) -> bool:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all; returns whether a file was replaced.

    ``where``: how the caller names the argument in an error (``"<argument>: -o x.toml"``). A
    replaced file keeps its permissions; a new one gets the process's default (``0o666 & ~umask``)."""
    real = target(path, where)
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    try:
        old = os.stat(real)
    except OSError:
        old = None
    tmp = real.parent / f".{real.name[:100]}.{secrets.token_hex(4)}.unimp-tmp"
    fd = -1
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        if old is not None:
            os.fchmod(fd, stat.S_IMODE(old.st_mode))
        _write_all(fd, data)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, real)
    except OSError as e:
        _discard(fd, tmp)
        raise _failed(where, real, e, "the existing file is unchanged" if old is not None
                      else "nothing was written") from None
    except BaseException:  # KeyboardInterrupt half-way: nothing left behind either
        _discard(fd, tmp)
        raise
    _sync_directory(real.parent)
    return old is not None


def _discard(fd: int, tmp: Path) -> None:
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        os.unlink(tmp)
    except OSError:
        pass


def _sync_directory(directory: Path) -> None:
    """The rename on disk too (best effort: not every file system or OS syncs a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class AppendLog:
    """An append-only log of complete lines: :meth:`append` writes one line whole or not at all.

    The file is created if missing and appended to otherwise; a line cut short by a full disk or
    the file size limit is truncated back before the :class:`FileError` is raised, so the log holds
    whole lines only. One writer per file (a truncation would undo another writer's line).

    >>> import pathlib, tempfile
    >>> log = AppendLog(pathlib.Path(tempfile.mkdtemp()) / "x.jsonl", where="path")
    >>> log.append('{"step": 0}\\n'); log.close(); log.path.read_text()
    '{"step": 0}\\n'
    """

    def __init__(self, path: Any, *, where: str, example: str = "numerics.jsonl") -> None:
        self.where = where
        self.path = target(path, where, example)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        try:  # non-blocking: a FIFO swapped in after the check is refused (ENXIO), never waited on
            self._fd = os.open(self.path, flags, 0o666)
        except OSError as e:
            raise _failed(where, self.path, e, "nothing was written") from None
        if not stat.S_ISREG(os.fstat(self._fd).st_mode):
            os.close(self._fd)
            raise FileError(f"{where}: {shown(self.path)} is not a regular file (swapped in after it was checked); "
                            f"name a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(self._fd, True)

    def append(self, line: str | bytes) -> None:
        """Append ``line`` (ending in a newline) whole; on failure the file is as it was before."""
        data = line.encode("utf-8") if isinstance(line, str) else bytes(line)
        if self._fd < 0:
            raise FileError(f"{self.where}: {shown(self.path)} is closed")
        start = os.fstat(self._fd).st_size
        try:
            _write_all(self._fd, data)
        except OSError as e:
            try:
                os.ftruncate(self._fd, start)  # the part of the line that made it to disk, removed
            except OSError:
                pass
            raise _failed(self.where, self.path, e, "this record was not written (the file ends with the "
                                                         "last whole record)") from None

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
