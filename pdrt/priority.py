"""A worker's CPU priority: its niceness, set on every thread, and the prefill worker's catch-up.

Linux keeps niceness per thread, so every thread started so far is reniced,
and those started later inherit it from the one that starts them.
"""

import math
import os
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)


def _threads() -> list[int]:
    return [int(tid) for tid in os.listdir("/proc/self/task")]


def take_priority(nice: int, name: str) -> bool:
    """Set the niceness of every thread of this process; False where lowering it is not permitted."""
    for _ in range(3):  # again, for a thread that a thread started while the last pass ran
        pending = [tid for tid in _threads() if os.getpriority(os.PRIO_PROCESS, tid) != nice]
        if not pending:
            return True
        for tid in pending:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            except ProcessLookupError:  # the thread has ended
                pass
            except PermissionError:  # lowering niceness needs CAP_SYS_NICE or RLIMIT_NICE: run on as it is
                log.warning("cannot set the process's niceness", process=name, nice=nice,
                            current=os.getpriority(os.PRIO_PROCESS, 0))
                return False
    return True


class CatchUp:
    """A prefill worker that yields the CPU while it keeps up and takes it back while it falls behind.

    It runs at `yield_nice` while every submitted prompt starts within
    `behind_s` of its arrival and has its first token within `late_s`, and at
    the niceness it started with from the moment one has waited longer (the
    worker looks in during its steps too: a prompt started at niceness 10
    while decode workers keep both cores busy crawls for seconds) until none
    has waited half as long. At nice 10 throughout, a prefill worker gets
    only what the decode workers, the gateway and the clients leave, and TTFT
    breaks first; at its starting niceness throughout, it stretches decode
    steps whenever long prompts come.

    Both limits shrink with the decode steps' room: `room()` is the share of
    the TPOT SLO that the decode workers' pace leaves unused (1: idle, or far
    within it; 0: at it or past it). With all the room, a prompt takes the CPU
    as soon as it waits; with none, only once it is late by the limits.
    """

    def __init__(self, yield_nice: int, behind_s: float, name: str, late_s: float = math.inf,
                 room: Callable[[], float] = lambda: 0.0) -> None:
        self.yield_nice = yield_nice
        self.behind_s = behind_s
        self.late_s = late_s
        self.room = room
        self.name = name
        self.start_nice = os.getpriority(os.PRIO_PROCESS, 0)
        self.yielding = True
        self.enabled = True  # False once returning to start_nice was refused
        self.num_catch_ups = 0
        self._caught_up_s = 0.0  # in catch-ups that have ended
        self._caught_up_at = 0.0  # time.monotonic() when the current one began
        take_priority(yield_nice, name)

    @property
    def caught_up_s(self) -> float:
        """Seconds spent catching up so far, the current catch-up included."""
        return self._caught_up_s + (0.0 if self.yielding else time.monotonic() - self._caught_up_at)

    def update(self, oldest_wait_s: float, oldest_age_s: float = 0.0) -> None:
        """Between steps: `oldest_wait_s`, how long the oldest prompt not yet started has waited, and
        `oldest_age_s`, how long the oldest one without its first token has been here (0: none)."""
        if not self.enabled:
            return
        behind_s, late_s = self._limits()
        if self.yielding and (oldest_wait_s > behind_s or oldest_age_s > late_s):
            self._catch_up(oldest_wait_s, oldest_age_s)
        elif not self.yielding and oldest_wait_s <= behind_s / 2 and oldest_age_s <= late_s / 2:
            take_priority(self.yield_nice, self.name)
            self.yielding = True
            self._caught_up_s += time.monotonic() - self._caught_up_at

    def check(self, oldest_age_s: float) -> None:
        """During a step: catch up if the oldest prompt without its first token has been here over `late_s`."""
        if self.enabled and self.yielding and oldest_age_s > self._limits()[1]:
            self._catch_up(0.0, oldest_age_s)

    def _limits(self) -> tuple[float, float]:
        """`behind_s` and `late_s` as the decode steps' room shrinks them."""
        scale = 1.0 - min(1.0, max(0.0, self.room()))
        return self.behind_s * scale, self.late_s * scale

    def _catch_up(self, oldest_wait_s: float, oldest_age_s: float) -> None:
        if not take_priority(self.start_nice, self.name):
            self.enabled = False
            return
        self.yielding = False
        self.num_catch_ups += 1
        self._caught_up_at = time.monotonic()
        log.debug("prefill worker catching up", waited_s=round(oldest_wait_s, 4), age_s=round(oldest_age_s, 4),
                  nice=self.start_nice)
