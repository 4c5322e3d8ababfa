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
"""

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def run_prefix(run_id: str) -> str:
    return f"pdrt-{run_id}-"


def process_prefix(run_id: str, name: str) -> str:
    # The trailing dash keeps "prefill-1" from matching the segments of "prefill-10".
    return f"pdrt-{run_id}-{name}-"


def make_run_dir(run_id: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=run_prefix(run_id)))


def remove_segments(prefix: str, shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink every segment whose name starts with `prefix`; the names removed.

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
        fd = os.open(_lock_path(run_id, shm_dir), os.O_CREAT | os.O_RDWR, 0o600)
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh random run id: nobody else holds it
    return fd


def unlock_run(run_id: str, fd: int | None, shm_dir: Path = SHM_DIR) -> None:
    if fd is not None:
        _lock_path(run_id, shm_dir).unlink(missing_ok=True)
        os.close(fd)


def sweep_dead_runs(shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove the segments and run directories of runs whose supervisor is gone; the run ids swept."""
    swept = []
    for lock in shm_dir.glob("pdrt-*.lock"):
        run_id = lock.name[len("pdrt-"):-len(".lock")]
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue  # gone meanwhile, or another user's
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # its supervisor is alive
        remove_segments(run_prefix(run_id), shm_dir)
        for run_dir in Path(tempfile.gettempdir()).glob(f"{run_prefix(run_id)}*"):
            shutil.rmtree(run_dir, ignore_errors=True)
        lock.unlink(missing_ok=True)
        os.close(fd)
        swept.append(run_id)
    return swept
