"""Output files of the command-line tools: written whole or not at all, never over one of the inputs.

Every file a CLI writes goes first to a temporary file in the same folder (so that the final rename stays within
one file system) and is renamed over its path only when the run has succeeded: a run that fails or is interrupted
leaves an existing file as it was, and a reader never sees half a file. A path that names an existing file which
is not a regular file (``/dev/null``, a FIFO, a terminal) cannot be renamed over; it is written directly.

``no_clobber`` (the commands' ``--no-clobber``) refuses an existing path: checked before the run (check_output),
and again when the file is put in place, by a hard link that fails if the path has appeared meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from collections.abc import Iterable, Iterator


class OutputError(Exception):
    """An output path that cannot be written, or that would overwrite an input; the message names it."""


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def check_output(path: str, inputs: Iterable[str] = (), what: str = "output", no_clobber: bool = False) -> None:
    """Raise OutputError if `path` is one of `inputs` (the same file by device and inode, whatever the names:
    hard links, symbolic links, relative paths), if its folder does not exist or cannot be written, or, with
    `no_clobber`, if it exists at all. An input named "-" is standard input, compared through its file descriptor."""
    out = _stat(path)
    if out is not None and no_clobber and stat.S_ISREG(out.st_mode):
        raise OutputError(f"{what} {path} exists and --no-clobber refuses to overwrite it")
    if out is not None:
        if stat.S_ISDIR(out.st_mode):
            raise OutputError(f"{what} {path} is a directory")
        for name in inputs:
            if name == "-":
                try:
                    st = os.fstat(sys.stdin.fileno())
                except (OSError, ValueError, AttributeError):  # no usable standard input (closed, replaced)
                    continue
            else:
                st = _stat(name)
            if st is not None and stat.S_ISREG(st.st_mode) and same_file(st, out):
                shown = "standard input" if name == "-" else name
                raise OutputError(f"{what} {path} is the same file as the input {shown}; write to another path")
        if not stat.S_ISREG(out.st_mode):
            return  # a device or FIFO: written directly, its folder does not matter
    folder = os.path.dirname(os.path.abspath(os.path.realpath(path)))
    if not os.path.isdir(folder):
        raise OutputError(f"{what} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {path}: the folder {folder} is not writable")


def check_stdout(inputs: Iterable[str]) -> None:
    """Raise OutputError if standard output is redirected to one of `inputs` (``>> input``: the run would read
    what it writes)."""
    try:
        out = os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no file descriptor (captured, closed)
        return
    if not stat.S_ISREG(out.st_mode):
        return
    for name in inputs:
        st = _stat(name) if name != "-" else None
        if st is not None and same_file(st, out):
            raise OutputError(f"standard output is redirected to the input {name}; write to another file")


def _final_mode(target: str) -> int:
    """Permissions for the new file: the existing file's, else what open() would give (0o666 less the umask)."""
    st = _stat(target)
    if st is not None:
        return stat.S_IMODE(st.st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _put_in_place(tmp: str, target: str, no_clobber: bool) -> None:
    """Rename `tmp` to `target`; with `no_clobber`, link it there instead (which fails if `target` exists, where a
    rename would replace it) and remove the temporary name."""
    if not no_clobber:
        os.replace(tmp, target)
        return
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise OutputError(f"{target} appeared during the run and --no-clobber refuses to overwrite it") from None
    except OSError:  # a file system without hard links: check, then rename (a narrow window, not none)
        if os.path.lexists(target):
            raise OutputError(f"{target} appeared during the run and --no-clobber refuses to overwrite it") from None
        os.replace(tmp, target)
        return
    os.unlink(tmp)


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", no_clobber: bool = False, **kwargs) -> Iterator:
    """Open `path` for writing through a temporary file that replaces it when the block exits without an error.

    On an exception (KeyboardInterrupt included) the temporary file is removed and `path` is left untouched.
    A symbolic link is followed: the file it points to is replaced, the link stays. With `no_clobber` an existing
    file is never replaced (OutputError). `kwargs` go to open().
    """
    if "w" not in mode:
        raise ValueError(f"atomic_open writes new files only (mode 'w' or 'wb'), got {mode!r}")
    target = os.path.realpath(path)
    st = _stat(target)
    if st is not None and not stat.S_ISREG(st.st_mode):
        with open(target, mode, **kwargs) as f:
            yield f
        return
    folder = os.path.dirname(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _final_mode(target))
        _put_in_place(tmp, target, no_clobber)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class AtomicGroup:
    """Several output files that appear together: each is written to a temporary file by `open(path, mode)`, and
    all are renamed into place by `commit()` (the context manager's clean exit); an error before that removes
    every temporary file and leaves every existing file as it was. With `no_clobber`, commit() first checks that
    none of the targets exists (and each is linked into place, never over a file)."""

    def __init__(self, no_clobber: bool = False) -> None:
        self._pending: list[tuple[str, str, int]] = []  # (temporary, target, mode)
        self.no_clobber = no_clobber

    def open(self, path: str, mode: str = "w", **kwargs):
        target = os.path.realpath(path)
        st = _stat(target)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise OutputError(f"{path} exists and is not a regular file")
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp",
                                   dir=os.path.dirname(target))
        self._pending.append((tmp, target, _final_mode(target)))
        return os.fdopen(fd, mode, **kwargs)

    def commit(self) -> None:
        if self.no_clobber:
            there = [t for _, t, _ in self._pending if os.path.lexists(t)]
            if there:
                raise OutputError(f"{', '.join(there)} exist(s) and --no-clobber refuses to overwrite")
        for tmp, target, mode in self._pending:
            os.chmod(tmp, mode)
            _put_in_place(tmp, target, self.no_clobber)
        self._pending.clear()

    def discard(self) -> None:
        for tmp, _, _ in self._pending:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        self._pending.clear()

    def __enter__(self) -> AtomicGroup:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            try:
                self.commit()
            except BaseException:
                self.discard()
                raise
        else:
            self.discard()
        return False
