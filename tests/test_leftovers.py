"""The sweep of dead runs trusts only what this user made: its own lock files, named by a real run id, and its own
segments and run directories. Another local user who plants files in /dev/shm or the temp directory can neither
make it delete what is not a dead run's nor make `pdrt up` fail."""

import os
import tempfile
from pathlib import Path

import pytest

from pdrt.supervisor.leftovers import lock_run, sweep_dead_runs, unlock_run

DEAD, LIVE = "0badc0de", "feedf00d"
OTHER_UID = 12345  # a uid no file of ours has: "another local user"

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making another user's files takes root")


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    path = tmp_path / "shm"
    path.mkdir()
    return path


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    path = tmp_path / "tmp"
    path.mkdir()
    return path


def segment(shm: Path, name: str, uid: int | None = None) -> Path:
    path = shm / name
    path.write_bytes(b"kv")
    if uid is not None:
        os.chown(path, uid, uid)
    return path


def run_dir(tmp: Path, run_id: str, uid: int | None = None) -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"pdrt-{run_id}-", dir=tmp))
    (path / "node.json").write_bytes(b"{}")
    if uid is not None:
        os.chown(path, uid, uid)
    return path


def dead_run(shm: Path, run_id: str) -> None:
    """A run whose supervisor died holding its lock: the file stays, and nobody holds the lock."""
    fd = lock_run(run_id, shm)
    assert fd is not None
    os.close(fd)


def test_a_dead_run_of_ours_is_swept_and_a_live_one_is_kept(shm: Path, tmp: Path):
    dead_run(shm, DEAD)
    live = lock_run(LIVE, shm)
    try:
        dead_segment, live_segment = segment(shm, f"pdrt-{DEAD}-decode-0-kv"), segment(shm, f"pdrt-{LIVE}-decode-0-kv")
        dead_dir, live_dir = run_dir(tmp, DEAD), run_dir(tmp, LIVE)

        assert sweep_dead_runs(shm, tmp) == [DEAD]

        assert not dead_segment.exists() and not dead_dir.exists() and not (shm / f"pdrt-{DEAD}.lock").exists()
        assert live_segment.exists() and (live_dir / "node.json").exists()
    finally:
        unlock_run(LIVE, live, shm)


def test_a_lock_that_is_a_symlink_is_ignored_and_its_target_untouched(shm: Path, tmp: Path, tmp_path: Path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"not a lock")
    (shm / f"pdrt-{DEAD}.lock").symlink_to(target)
    kept_segment, kept_dir = segment(shm, f"pdrt-{DEAD}-decode-0-kv"), run_dir(tmp, DEAD)

    assert sweep_dead_runs(shm, tmp) == []

    assert target.read_bytes() == b"not a lock" and (shm / f"pdrt-{DEAD}.lock").is_symlink()
    assert kept_segment.exists() and (kept_dir / "node.json").exists()


@pytest.mark.parametrize("run_id", ["*", "????????", f"{LIVE}-decode", LIVE[:-1], LIVE.upper(), f"{LIVE}0"])
def test_a_lock_whose_name_is_not_a_run_id_is_ignored_and_spares_a_live_run(shm: Path, tmp: Path, run_id: str):
    """A glob pattern, a run id and a process name, a prefix of a run id: each would reach a live run's files."""
    planted = shm / f"pdrt-{run_id}.lock"
    planted.write_bytes(b"")
    live = lock_run(LIVE, shm)
    try:
        live_segment, live_dir = segment(shm, f"pdrt-{LIVE}-decode-0-kv"), run_dir(tmp, LIVE)

        assert sweep_dead_runs(shm, tmp) == []

        assert planted.exists() and live_segment.exists() and (live_dir / "node.json").exists()
    finally:
        unlock_run(LIVE, live, shm)


@as_root
def test_a_lock_of_another_user_is_ignored_and_nothing_of_theirs_is_removed(shm: Path, tmp: Path):
    dead_run(shm, DEAD)
    os.chown(shm / f"pdrt-{DEAD}.lock", OTHER_UID, OTHER_UID)
    their_segment = segment(shm, f"pdrt-{DEAD}-decode-0-kv", uid=OTHER_UID)
    their_dir = run_dir(tmp, DEAD, uid=OTHER_UID)

    assert sweep_dead_runs(shm, tmp) == []

    assert (shm / f"pdrt-{DEAD}.lock").exists() and their_segment.exists() and (their_dir / "node.json").exists()


@as_root
def test_a_sweep_removes_only_our_own_segments_and_real_directories(shm: Path, tmp: Path, tmp_path: Path):
    dead_run(shm, DEAD)
    our_segment = segment(shm, f"pdrt-{DEAD}-decode-0-kv")
    their_segment = segment(shm, f"pdrt-{DEAD}-planted", uid=OTHER_UID)
    our_dir, their_dir = run_dir(tmp, DEAD), run_dir(tmp, DEAD, uid=OTHER_UID)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep").write_bytes(b"x")
    (tmp / f"pdrt-{DEAD}-link").symlink_to(precious, target_is_directory=True)

    assert sweep_dead_runs(shm, tmp) == [DEAD]

    assert not our_segment.exists() and not our_dir.exists()
    assert their_segment.exists() and (their_dir / "node.json").exists()
    assert (tmp / f"pdrt-{DEAD}-link").is_symlink() and (precious / "keep").exists()


def test_locking_a_run_does_not_follow_a_planted_symlink(shm: Path, tmp_path: Path):
    target = tmp_path / "planted"
    (shm / f"pdrt-{DEAD}.lock").symlink_to(target)

    assert lock_run(DEAD, shm) is None  # the run goes on unlocked: never swept, and nothing created elsewhere

    assert not target.exists()
