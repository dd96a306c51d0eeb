"""Safe run and cache directories: an exclusive lock per run directory, writes that name
their file when the disk says no, and file modes that follow the umask.

- :func:`lock_run_dir` takes ``fcntl.flock`` on ``run_dir/.lock``: a second process on
  the same run directory is refused with a message naming the directory and the pid that
  holds it. The kernel drops the lock when its holder exits, however it exits (SIGKILL
  included), so a stale ``.lock`` file never blocks a later run.
- :func:`writing` re-raises an ``OSError`` that carries no file name (a ``write`` hitting
  a full disk, ``ENOSPC``, or a file-size limit, ``EFBIG``) with the file's name, so the
  CLI can print one line naming it; safetensors' own I/O error (a ``SafetensorError``
  ending in ``(os error N)``) becomes the same ``OSError``, its errno read from ``N``.
- :func:`share_like_umask` gives files ``0666 & ~umask`` and directories ``0777 & ~umask``
  (safetensors writes 0600), so a shared SFT cache is readable by the other users.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import tempfile
from pathlib import Path

LOCK_NAME = ".lock"


class RunDirLocked(ValueError):
    """Another live process holds the run directory's lock (a user error: exit code 2)."""


class RunLock:
    """An exclusive ``flock`` on ``run_dir/.lock``; :meth:`release` (or process exit) drops it."""

    def __init__(self, run_dir: Path, fd: int):
        self.run_dir, self._fd = run_dir, fd

    def release(self) -> None:
        if self._fd is not None:
            import fcntl

            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:  # a lost reference must not keep the directory locked
        with contextlib.suppress(Exception):
            self.release()


def lock_run_dir(run_dir: str | Path) -> RunLock:
    """Lock ``run_dir`` (created if missing) for this process, or raise :class:`RunDirLocked`
    naming the directory and the holder's pid."""
    import fcntl

    d = Path(run_dir)
    with writing(d):
        d.mkdir(parents=True, exist_ok=True)
    path = d / LOCK_NAME
    with writing(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            os.close(fd)
            raise
        holder = _read_pid(fd)
        os.close(fd)
        who = f"pid {holder}" if holder else "another process"
        raise RunDirLocked(f"name: run directory {str(d)!r} is in use by {who} (lock {str(path)!r}); wait for it "
                           "to finish, stop it, or choose another name=") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return RunLock(d, fd)


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def writing(path: str | Path):
    """Name ``path`` in an ``OSError`` raised without a file name (e.g. ENOSPC on write)."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror or os.strerror(e.errno), str(path)) from e
        raise
    except Exception as e:
        # safetensors reports a failed write as its own SafetensorError, not an OSError
        code = _safetensors_errno(e)
        if code is None:
            raise
        raise OSError(code, os.strerror(code), str(path)) from e


#: the OS error number in safetensors' message: "I/O error: File too large (os error 27)"
#: (0.5 and later) or the Rust debug form "IoError(Os { code: 28, ... })" (older releases)
_OS_ERROR = re.compile(r"\(os error (\d+)\)|\bOs \{ code: (\d+)")


def _safetensors_errno(e: BaseException) -> int | None:
    """The errno of a safetensors I/O failure (EFBIG, ENOSPC, ...), None for any other error."""
    if type(e).__name__ != "SafetensorError":
        return None
    m = _OS_ERROR.search(str(e))
    return int(m.group(1) or m.group(2)) if m else None


def umask() -> int:
    """The process umask (read without changing it for longer than one call)."""
    old = os.umask(0o022)
    os.umask(old)
    return old


def share_like_umask(path: str | Path) -> None:
    """Files under ``path`` (and ``path``) get ``0666 & ~umask``, directories ``0777 & ~umask``."""
    m = umask()
    p = Path(path)
    for q in [p, *p.rglob("*")] if p.is_dir() else [p]:
        if q.is_symlink():
            continue
        os.chmod(q, (0o777 if q.is_dir() else 0o666) & ~m)


def check_writable_dir(path: str | Path, key: str) -> None:
    """``path`` is (or can be created as) a directory this process can write in; else a
    ValueError naming ``key`` and the path."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{key}: {str(p)!r} is a file, not a directory")
    probe_base = p
    while not probe_base.exists():  # the nearest existing ancestor must let us create p
        probe_base = probe_base.parent
    if not probe_base.is_dir():
        raise ValueError(f"{key}: {str(probe_base)!r} (a parent of {str(p)!r}) is a file, not a directory")
    try:
        fd, name = tempfile.mkstemp(prefix=".pdmask-write-test-", dir=probe_base)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise ValueError(f"{key}: cannot write in {str(probe_base)!r} ({e.strerror or e})") from None
