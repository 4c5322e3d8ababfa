"""The thread ledger: decode workers borrow the threads of idle prefill workers of their run, and only those."""

import pytest

from pdrt.roles import thread_ledger
from pdrt.roles.thread_ledger import ThreadLedger
from pdrt.supervisor.leftovers import process_prefix, remove_segments


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    monkeypatch.setattr(thread_ledger, "RESCAN_S", 0.0)  # every call sees the peers as they are now
    made: list[ThreadLedger] = []

    def make(process_id: str, threads: int = 1, borrow: bool = True, run_id: str = "run1") -> ThreadLedger:
        role = process_id.split("-", 1)[0]
        made.append(ThreadLedger(run_id, process_id, role, threads, borrow, shm_dir=tmp_path))
        return made[-1]

    yield make
    for entry in made:
        entry.close()


def test_decode_borrows_an_idle_prefill_workers_threads_and_gives_them_back_when_it_is_busy(ledger):
    decode = ledger("decode-0")
    prefill = ledger("prefill-0", threads=3)
    assert decode.threads_for_step() == 4
    prefill.set_busy(True)
    assert decode.threads_for_step() == 1
    prefill.set_busy(False)
    assert decode.threads_for_step() == 4


def test_decode_workers_share_the_idle_threads(ledger):
    decodes = [ledger("decode-0"), ledger("decode-1")]
    ledger("prefill-0", threads=2)
    ledger("prefill-1", threads=2)
    assert [d.threads_for_step() for d in decodes] == [3, 3]


def test_nothing_is_borrowed_without_borrow_from_other_runs_or_from_decode_peers(ledger):
    assert ledger("decode-0", borrow=False).threads_for_step() == 1
    ledger("prefill-0", threads=4, run_id="run2")
    ledger("decode-9", threads=4)
    assert ledger("decode-1").threads_for_step() == 1  # its only peer of run1 is decode-9, which lends nothing


def test_a_crashed_prefill_workers_segment_removed_by_the_supervisor_lends_nothing(ledger, tmp_path):
    decode = ledger("decode-0")
    prefill = ledger("prefill-0", threads=2)
    assert decode.threads_for_step() == 3
    assert remove_segments(process_prefix("run1", "prefill-0"), shm_dir=tmp_path) == [prefill.path.name]
    assert decode.threads_for_step() == 1


def test_a_worker_that_changes_role_lends_or_borrows_as_its_new_role(ledger):
    decode = ledger("decode-0")
    other = ledger("prefill-0", threads=2)
    assert decode.threads_for_step() == 3
    other.set_role("decode", borrow=True)  # now a decode worker: it lends nothing and shares what idles
    assert decode.threads_for_step() == 1
    decode.set_role("prefill", borrow=False)
    assert other.threads_for_step() == 3


def test_close_removes_the_workers_segment(ledger, tmp_path):
    prefill = ledger("prefill-0")
    assert prefill.path.exists()
    prefill.close()
    assert not prefill.path.exists()
    assert ledger("decode-0").threads_for_step() == 1


def test_a_prefill_worker_reads_the_pace_of_the_slowest_busy_decode_worker(ledger):
    prefill = ledger("prefill-0")
    fast, slow = ledger("decode-0"), ledger("decode-1")
    assert prefill.decode_pace_s() == 0.0  # none busy: no pace to keep
    fast.set_busy(True)
    fast.add_pace(0.02)
    slow.add_pace(0.09)
    assert prefill.decode_pace_s() == pytest.approx(0.02)  # the idle one's pace does not count
    slow.set_busy(True)
    assert prefill.decode_pace_s() == pytest.approx(0.09)
    slow.add_pace(0.19)  # smoothed: one slow step moves the pace part of the way
    assert 0.09 < prefill.decode_pace_s() < 0.19
