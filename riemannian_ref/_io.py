"""Atomic file writes and early checks of output paths (private).

Every file the package writes goes through :func:`atomic_write`: the bytes go
to a fresh temporary file in the target's directory, are flushed to disk
(``fsync``), and the temporary file is renamed over the target
(``os.replace``, atomic on POSIX and Windows within one file system). A
process killed at any moment therefore leaves either the complete old file or
the complete new one, never a truncated mix. A kill can leave a temporary
file behind (``.<name>.<random>.tmp`` next to the target); it is never read.

:func:`check_writable` creates and removes a probe file in the target's
directory, so a path that cannot be written is refused when a run starts,
not when its first checkpoint is due.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__: list[str] = []  # private module


def _read_umask() -> int:
    # read once, at import: os.umask can only be read by setting it, which is not thread-safe later
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def _fsync_dir(directory: str) -> None:
    """Flush the directory entry (the rename) to disk where the platform allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened; the rename is durable there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _target(path: str | os.PathLike, what: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{what} must be a str or path-like, got {type(path).__name__}")
    path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not path:
        raise ValueError(f"{what} must name a file, got an empty path")
    return path


def check_writable(path: str | os.PathLike, what: str = "path") -> str:
    """Refuse, naming ``path``, a file that could not be written atomically; returns ``path`` as a str.

    Creates the parent directories if they are missing (as a write would),
    then creates and removes a probe file next to ``path``.

    Raises
    ------
    ValueError
        If ``path`` is a directory, its parent cannot be created, or the
        parent directory does not accept new files.
    """
    path = _target(path, what)
    if os.path.isdir(path):
        raise ValueError(f"{what} {path!r} is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".probe", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"{what} {path!r} cannot be written: {exc.strerror or exc} "
                         f"(in directory {parent!r})") from None
    return path


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], what: str = "path") -> None:
    """Write ``path`` all at once: ``write(tmp)`` fills a temporary file, which then replaces ``path``.

    Parameters
    ----------
    path : str or path-like
        The file to (over)write.
    write : callable
        Called with the temporary file's name; writes the whole content
        there (e.g. ``lambda f: torch.save(obj, f)``).
    what : str
        How error messages name ``path`` (e.g. ``"checkpoint_path"``).

    Raises
    ------
    ValueError
        Naming ``path``, if it cannot be written (see :func:`check_writable`).
        An exception raised by ``write`` propagates unchanged after the
        temporary file is removed; ``path`` is then untouched.
    """
    path = check_writable(path, what)
    parent = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        try:  # the permissions an ordinary open() would give (mkstemp makes the file 0600)
            os.chmod(tmp, 0o666 & ~_UMASK)
        except OSError:
            pass
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(parent)


def atomic_write_text(path: str | os.PathLike, text: str, what: str = "path") -> None:
    """:func:`atomic_write` for a text file (UTF-8)."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"), what)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, what: str = "path") -> None:
    """:func:`atomic_write` for a binary file."""
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(data), what)
