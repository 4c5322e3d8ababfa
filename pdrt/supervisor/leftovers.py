"""What a run leaves behind: shared-memory segments in /dev/shm and its run directory.

Every segment of one `pdrt up` run is a file named `pdrt-<run_id>-...`, and a
process's own are `pdrt-<run_id>-<name>-...`. A process killed mid-way cannot
unlink its segments, and each may hold a whole KV pool, so the supervisor
removes them: a crashed process's before it restarts, and all of the run's at
exit.

A supervisor that is itself SIGKILLed cleans up nothing, so each run also
holds an flock on `/dev/shm/pdrt-<run_id>.lock` while it lives. The kernel
drops that lock when the supervisor dies, however it dies; the next
supervisor on the host finds lock files it can take, and removes those dead
runs' segments and run directories. Runs without a lock file (processes
started by hand or by tests) are never touched.

/dev/shm and the temp directory are shared by every local user, so the sweep
trusts nothing another user could have planted there. A lock counts only if
it is a regular file (not a link) owned by this user and named by a run id
as `new_run_id` makes them, so no name can widen its prefix to another run's
files or into a glob pattern; and only this user's segments and run
directories (real directories, not links) are removed. Taking a lock creates
a fresh file and never follows a link.
"""

import fcntl
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

SHM_DIR = Path("/dev/shm")
RUN_ID = re.compile(r"[0-9a-f]{8}")  # what supervisor.new_run_id makes: secrets.token_hex(4)


def run_prefix(run_id: str) -> str:
    return f"pdrt-{run_id}-"


def process_prefix(run_id: str, name: str) -> str:
    # The trailing dash keeps "prefill-1" from matching the segments of "prefill-10".
    return f"pdrt-{run_id}-{name}-"


def is_run_id(text: str) -> bool:
    return RUN_ID.fullmatch(text) is not None


def _is_ours(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid()


def make_run_dir(run_id: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=run_prefix(run_id)))


def remove_segments(prefix: str, shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink every segment of ours whose name starts with `prefix`; the names removed.

    Unlinking only drops the name: a process that still maps a segment keeps
    its memory until it unmaps it.
    """
    removed = []
    try:
        entries = list(shm_dir.iterdir())
    except OSError:
        return removed
    for path in entries:
        if path.name.startswith(prefix):
            try:
                if _is_ours(path.lstat()):
                    path.unlink()
                    removed.append(path.name)
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                pass
    return removed


def _lock_path(run_id: str, shm_dir: Path) -> Path:
    return shm_dir / f"pdrt-{run_id}.lock"


def lock_run(run_id: str, shm_dir: Path = SHM_DIR) -> int | None:
    """Mark the run as alive for as long as this process holds the returned descriptor (None: no /dev/shm)."""
    try:
        # A fresh random run id has no lock file yet: one that exists, or a link, was planted.
        fd = os.open(_lock_path(run_id, shm_dir), os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR, 0o600)
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh random run id: nobody else holds it
    return fd


def unlock_run(run_id: str, fd: int | None, shm_dir: Path = SHM_DIR) -> None:
    if fd is not None:
        _lock_path(run_id, shm_dir).unlink(missing_ok=True)
        os.close(fd)


def sweep_dead_runs(shm_dir: Path = SHM_DIR, temp_dir: Path | None = None) -> list[str]:
    """Remove the segments and run directories of our runs whose supervisor is gone; the run ids swept."""
    swept = []
    for lock in shm_dir.glob("pdrt-*.lock"):
        run_id = lock.name[len("pdrt-"):-len(".lock")]
        fd = _take_dead_lock(lock) if is_run_id(run_id) else None
        if fd is None:
            continue
        remove_segments(run_prefix(run_id), shm_dir)
        _remove_run_dirs(run_id, temp_dir or Path(tempfile.gettempdir()))
        lock.unlink(missing_ok=True)
        os.close(fd)
        swept.append(run_id)
    return swept


def _take_dead_lock(lock: Path) -> int | None:
    """A descriptor holding `lock` if it is our own regular file and its run is dead; None otherwise."""
    try:
        # O_NONBLOCK: a planted FIFO must not hang the open.
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None  # gone meanwhile, a link, or another user's
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and _is_ours(st):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
    except OSError:
        pass  # BlockingIOError: its supervisor is alive
    os.close(fd)
    return None


def _remove_run_dirs(run_id: str, temp_dir: Path) -> None:
    for run_dir in temp_dir.glob(f"{run_prefix(run_id)}*"):
        try:
            st = run_dir.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and _is_ours(st):
            shutil.rmtree(run_dir, ignore_errors=True)
