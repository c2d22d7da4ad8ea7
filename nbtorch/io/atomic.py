"""Atomic file output.

Every writer in :mod:`nbtorch.io` goes through this module, so that an output
file either appears complete or not at all:

1. the data are written to a hidden temporary file in the *same directory* as
   the target (``.<name>.<random>.tmp``), so the final rename cannot cross a
   file system;
2. the temporary file is flushed and ``fsync``-ed;
3. it is renamed over the target with :func:`os.replace` (atomic on POSIX and
   Windows);
4. if anything raises before step 3, the temporary file is removed and the
   exception propagates unchanged; an existing target is left untouched.

The new file gets the usual permissions (``0o666`` minus the umask), not the
``0o600`` that :func:`tempfile.mkstemp` would leave.

Use :func:`atomic_write` for a file object, or :func:`atomic_output_path` when a
library (h5py) wants a file name.  :func:`write_files_together` writes several
files as one step: every file is complete in its temporary file before the
first is renamed, so a failure leaves none of them.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator, Sequence, Union

from nbtorch.errors import InputError

__all__ = ["atomic_write", "atomic_output_path", "write_files_together", "check_directory_can_be_made", "check_not_inputs"]


def check_directory_can_be_made(directory: str | os.PathLike[str], label: str) -> None:
    """Raise :class:`InputError` (starting with ``label``) unless ``directory`` exists or can be created:
    its nearest existing ancestor must be a writable directory.  Creates nothing."""
    ancestor = Path(directory).absolute()
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise InputError(f"{label}: cannot make directory {directory}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise InputError(f"{label}: directory {ancestor} is not writable")


def check_not_inputs(inputs: Iterable[tuple[str, str | None]], outputs: Iterable[tuple[str, str | None]]) -> None:
    """Raise :class:`InputError` if an output path is one of the input files (it would be overwritten).

    ``inputs`` and ``outputs`` are ``(flag, path)`` pairs (paths None or empty are skipped); paths are
    compared after resolving symbolic links.
    """
    named = {os.path.realpath(path): flag for flag, path in inputs if path}
    for flag, path in outputs:
        if path and os.path.realpath(path) in named:
            raise InputError(f"{flag} {path}: would overwrite the {named[os.path.realpath(path)]} input file")


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _make_temp(path: Path) -> tuple[int, Path]:
    directory = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise InputError(f"{path}: cannot write file: it is a directory")
    if directory.exists() and not directory.is_dir():
        raise InputError(f"{path}: cannot write file: {directory} is not a directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except FileNotFoundError:
        raise InputError(f"{path}: cannot write file: directory {directory} does not exist") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot write file: {exc.strerror or exc}") from None
    try:
        os.chmod(tmp, 0o666 & ~_current_umask())
    except OSError:  # pragma: no cover - best effort only
        pass
    return fd, Path(tmp)


def _fsync_directory(directory: Path) -> None:
    """Best-effort fsync of a directory so the rename itself is durable."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_quietly(tmp: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(tmp)


def _commit(tmp: Path, path: Path) -> None:
    try:
        os.replace(tmp, path)
    except OSError as exc:
        _remove_quietly(tmp)
        raise InputError(f"{path}: cannot write file: {exc.strerror or exc}") from None
    _fsync_directory(path.parent if str(path.parent) else Path("."))


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "wb", encoding: str = "utf-8") -> Iterator[IO]:
    """Open a temporary file beside ``path``; on success rename it to ``path``.

    ``mode`` is one of ``'wb'``, ``'w+b'``, ``'w'`` or ``'w+'``; text modes use
    ``encoding`` and ``'\\n'`` line endings on every platform.  If the body of
    the ``with`` block raises, the temporary file is deleted and nothing is
    written.  A directory that does not exist raises
    :class:`~nbtorch.errors.InputError`.
    """
    if mode not in ("wb", "w+b", "w", "w+"):
        raise ValueError(f"atomic_write: unsupported mode {mode!r}")
    path = Path(path)
    fd, tmp = _make_temp(path)
    try:
        if "b" in mode:
            handle = os.fdopen(fd, mode)
        else:
            handle = os.fdopen(fd, mode, encoding=encoding, newline="\n")
    except BaseException:
        os.close(fd)
        _remove_quietly(tmp)
        raise
    try:
        with handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        _remove_quietly(tmp)
        raise
    _commit(tmp, path)


@contextlib.contextmanager
def atomic_output_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it to ``path``.

    For libraries that open the file themselves (e.g. ``h5py.File``).  The
    caller must have closed the file before the ``with`` block ends.  On an
    exception the temporary file is removed and nothing is written.
    """
    path = Path(path)
    fd, tmp = _make_temp(path)
    os.close(fd)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        _remove_quietly(tmp)
        raise
    _commit(tmp, path)


#: What :func:`write_files_together` writes to a file: its bytes, or a function that writes the file at a path.
FileContent = Union[bytes, Callable[[Path], None]]


def write_files_together(files: Sequence[tuple[str | os.PathLike[str], FileContent]]) -> None:
    """Write several files so that a failure leaves none of them (nor any temporary file).

    ``files`` holds ``(path, content)`` pairs; ``content`` is the file's bytes
    or a function that writes the file at the temporary path it is given (for
    libraries such as h5py).  First every file is written to its temporary
    file beside the target and fsync-ed; only when all are complete are they
    renamed over their targets, in order.  If writing any of them raises, all
    the temporary files are removed and no target is touched.  If a rename
    fails (rare: the temporary file sits in the target's own directory), the
    targets already renamed that did not exist before are removed again.
    """
    staged: list[tuple[Path, Path, bool]] = []
    try:
        for target, content in files:
            path = Path(target)
            fd, tmp = _make_temp(path)
            staged.append((path, tmp, path.exists()))
            if callable(content):
                os.close(fd)
                content(tmp)
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            else:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(content)
                    handle.flush()
                    os.fsync(handle.fileno())
    except BaseException:
        for _, tmp, _ in staged:
            _remove_quietly(tmp)
        raise
    done: list[tuple[Path, bool]] = []
    for index, (path, tmp, existed) in enumerate(staged):
        try:
            _commit(tmp, path)
        except BaseException:
            for _, later, _ in staged[index + 1:]:
                _remove_quietly(later)
            for written, had_file in done:
                if not had_file:
                    _remove_quietly(written)
            raise
        done.append((path, existed))
