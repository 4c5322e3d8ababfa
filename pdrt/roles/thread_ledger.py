"""Threads that idle prefill workers lend to the decode workers of the same run on this host.

On a CPU host whose cores are split between prefill and decode workers, a
prefill worker waits for prompts much of the time, while decode, which steps
without pause under load, is the bottleneck. Each worker of a run publishes
its own thread count and whether it has work in a shared-memory segment of
8 bytes, `pdrt-<run>-<process>-threads`. Before each step, a decode worker
that borrows runs with its own threads plus its share of the threads of the
run's prefill workers that are idle at that moment (shared evenly among the
run's decode workers). A worker's entry says its role, which may change
while it runs (pdrt/roles/split_worker.py).

A prefill worker that gets work takes its core back at the decode worker's
next step; until then (one decode step at most) the two share it. Prefill
never borrows: its steps last seconds, and a decode worker that needed its
core back would wait for one.

A busy decode worker also publishes its pace, the seconds its recent steps
took per token of a stream: a prefill worker reads how much room the decode
steps have against the TPOT SLO there (pdrt/priority.py, CatchUp).

The segments follow the run's naming, so the supervisor removes a crashed
worker's with its KV pool. A segment holds four int32s, each written whole
and aligned: a reader sees the old or the new value, never a torn one.
"""

import mmap
import os
import struct
import time
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

SHM_DIR = Path("/dev/shm")
SUFFIX = "-threads"
RESCAN_S = 1.0  # how stale the list of peers may be: workers restart rarely
_LAYOUT = struct.Struct("<iiii")  # threads, busy, role, pace in microseconds per token
PACE_SMOOTHING = 0.3  # the weight of the latest step in the published pace
ROLE_CODES = {"prefill": 1, "decode": 2}


class ThreadLedger:
    """This worker's entry in the run's ledger and, for a decode worker, the threads it may use now."""

    def __init__(self, run_id: str, process_id: str, role: str, threads: int, borrow: bool,
                 shm_dir: Path = SHM_DIR) -> None:
        self.prefix = f"pdrt-{run_id}-"
        self.shm_dir = shm_dir
        self.threads = threads
        self.borrow = borrow
        self.role = ROLE_CODES.get(role, 0)
        self.path = shm_dir / f"{self.prefix}{process_id}{SUFFIX}"
        self._own = self._map(self.path, create=True)
        self._busy = False
        self._pace_us = 0
        self._publish()
        self._peers: dict[Path, mmap.mmap] = {}
        self._scanned_at = float("-inf")

    @staticmethod
    def _map(path: Path, create: bool = False) -> mmap.mmap:
        fd = os.open(path, (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY, 0o600)
        try:
            if create:
                os.ftruncate(fd, _LAYOUT.size)
            return mmap.mmap(fd, _LAYOUT.size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if create else 0))
        finally:
            os.close(fd)

    def _publish(self) -> None:
        _LAYOUT.pack_into(self._own, 0, self.threads, int(self._busy), self.role, self._pace_us)

    def set_busy(self, busy: bool) -> None:
        if busy != self._busy:
            self._busy = busy
            self._publish()

    def add_pace(self, seconds_per_token: float) -> None:
        """A decode step took this long per token of each stream: fold it into the published pace."""
        latest = min(int(seconds_per_token * 1e6), 2**31 - 1)
        self._pace_us = latest if not self._pace_us else round(
            (1 - PACE_SMOOTHING) * self._pace_us + PACE_SMOOTHING * latest)
        self._publish()

    def set_role(self, role: str, borrow: bool) -> None:
        self.role, self.borrow = ROLE_CODES.get(role, 0), borrow
        self._publish()

    def _rescan(self) -> None:
        found = {p for p in self.shm_dir.glob(f"{self.prefix}*{SUFFIX}") if p != self.path}
        for path in set(self._peers) - found:
            self._peers.pop(path).close()
        for path in found - set(self._peers):
            try:
                self._peers[path] = self._map(path)
            except (OSError, ValueError):  # removed meanwhile, or not yet sized by its owner
                continue
        self._scanned_at = time.monotonic()

    def threads_for_step(self) -> int:
        """Own threads, plus this worker's share of the idle prefill workers' when it borrows."""
        if not self.borrow:
            return self.threads
        if time.monotonic() - self._scanned_at > RESCAN_S:
            self._rescan()
        idle, num_borrowers = 0, 1
        for mapping in self._peers.values():
            threads, busy, role, _ = _LAYOUT.unpack_from(mapping, 0)
            if role == ROLE_CODES["prefill"] and not busy:
                idle += max(0, threads)
            elif role == ROLE_CODES["decode"]:
                num_borrowers += 1
        return self.threads + idle // num_borrowers

    def decode_pace_s(self) -> float:
        """The pace of the slowest busy decode worker of the run on this host, seconds per token; 0: none busy."""
        if time.monotonic() - self._scanned_at > RESCAN_S:
            self._rescan()
        paces = [pace for _, busy, role, pace in (_LAYOUT.unpack_from(m, 0) for m in self._peers.values())
                 if role == ROLE_CODES["decode"] and busy]
        return max(paces, default=0) / 1e6

    def close(self) -> None:
        for mapping in self._peers.values():
            mapping.close()
        self._peers.clear()
        self._own.close()
        self.path.unlink(missing_ok=True)
