"""One harvest job per output folder: an exclusive lock on a file in the folder, held while the job runs.

The lock is `flock` on `.harvest.lock`, which the kernel lets go of when its process ends, however it ends
(kill -9 included): a lock file a killed job left behind holds nothing and blocks nothing. The file names
its holder (pid and host) for the refusal a second job gets, and the holder removes it as it finishes. Only
the job's driver locks: Ray's workers write their shards into the folder under the driver's lock.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from pathlib import Path

from .errors import HarvestError

log = logging.getLogger(__name__)

LOCK = ".harvest.lock"


class FolderLock:
    """The lock of one output folder, held by this process until `release`."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, folder: Path) -> FolderLock | None:
        """Lock `folder` for this job, or refuse at once (`HarvestError`) if another job holds it; None
        where the filesystem or the system cannot lock (then a warning says that nothing keeps a second job
        out; none on a read-only filesystem, where a complete job reads its folder and any other fails in one
        line as it writes)."""
        try:
            import fcntl  # POSIX: imported here, so that `model` imports on Windows too
        except ImportError:
            _warn_unlocked(folder, "this system has no flock")
            return None
        path = folder / LOCK
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                if not folder.is_dir():  # a job failing before its first shard removed it as this one started
                    raise HarvestError(f"{folder} was removed as this job started: start it again") from None
                if e.errno != errno.EROFS:  # a read-only folder needs no lock: no job can write there
                    _warn_unlocked(folder, e.strerror)
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise HarvestError(
                    f"another harvest job{holder} is writing to {folder}; wait for it or pick another --out"
                ) from None
            except OSError as e:  # a filesystem without locks (ENOLCK, EOPNOTSUPP)
                os.close(fd)
                _warn_unlocked(folder, e.strerror)
                return None
            if _same_file(fd, path):
                break
            os.close(fd)  # locked a file its holder removed as it finished: lock the one at the path now
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        return cls(path, fd)

    def release(self) -> None:
        """Remove the lock file, then let go of the lock (the other way round, a job locking the file in
        between would hold a file no longer there, beside a third job's new one); a second call does nothing.
        A file at the path that is not this lock's (a job that removed its empty folder's files let the next
        job lock a new one) is left to its holder."""
        if self._fd < 0:
            return
        try:
            if _same_file(self._fd, self.path):
                self.path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("could not remove %s: %s (it blocks nothing)", self.path, e)
        os.close(self._fd)
        self._fd = -1


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _holder(fd: int) -> str:
    """' (pid N)', or ' (pid N on HOST)' for another machine's, from the lock file; '' if it names none yet."""
    try:
        pid, host = os.pread(fd, 300, 0).decode().split()
    except (OSError, ValueError):  # not written yet (its holder has just locked it), or not ours
        return ""
    return f" (pid {pid})" if host == socket.gethostname() else f" (pid {pid} on {host})"


def _warn_unlocked(folder: Path, reason: str | None) -> None:
    log.warning("cannot lock %s (%s): nothing keeps a second harvest job from writing there too", folder, reason)
