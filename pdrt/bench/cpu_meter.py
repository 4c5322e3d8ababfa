"""Where the CPU went while a rate ran: the machine's busy cores and each server process's share, from /proc.

A goodput figure on a small host is only read right next to its ceiling: a
server that leaves cores idle at the rate where it breaks has time to win
back, one that uses them all does not. `CpuMeter` reads the cumulative
counters of the kernel before and after a measured span (one pass over
/proc's process table each, some milliseconds), so it runs around every rate
of a ladder. Linux only: elsewhere `read()` returns None.
"""

import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True, slots=True)
class CpuUsage:
    """Cores in use over a span of `seconds`, on average: the whole machine's, and each named process's."""

    cores: int
    seconds: float
    busy: float
    stolen: float  # cores the hypervisor gave to other guests while this one had work for them
    processes: dict[str, float]

    def describe(self) -> str:
        parts = ", ".join(f"{name} {used:.2f}" for name, used in sorted(self.processes.items(),
                                                                         key=lambda item: -item[1]))
        return f"CPU {self.busy:.2f} of {self.cores} cores busy ({parts}), {self.stolen:.2f} stolen"

    @classmethod
    def pooled(cls, spans: "list[CpuUsage]") -> "CpuUsage | None":
        """The spans as one, each weighted by its length (slices of one kind, run apart); None for none."""
        seconds = sum(span.seconds for span in spans)
        if not spans or seconds <= 0:
            return None
        processes: dict[str, float] = {}
        for span in spans:
            for name, used in span.processes.items():
                processes[name] = processes.get(name, 0.0) + used * span.seconds / seconds
        return cls(spans[0].cores, seconds, sum(span.busy * span.seconds for span in spans) / seconds,
                   sum(span.stolen * span.seconds for span in spans) / seconds, processes)

    def as_dict(self) -> dict:
        return {"cores": self.cores, "seconds": round(self.seconds, 2), "busy": round(self.busy, 3),
                "stolen": round(self.stolen, 3),
                "processes": {name: round(used, 3) for name, used in self.processes.items()}}


@dataclass(frozen=True, slots=True)
class _Sample:
    at: float
    machine_busy: int  # ticks, all cores
    machine_stolen: int
    processes: dict[int, tuple[str, int]]  # pid -> (name, utime + stime ticks)


def _machine_ticks() -> tuple[int, int]:
    """(busy, stolen) ticks of every core since boot: busy is user, nice, system, irq and softirq time."""
    fields = (PROC / "stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return user + nice + system + irq + softirq, steal


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, utime + stime) of a live process; None once it is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return int(fields[1]), int(fields[11]) + int(fields[12])


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system) that process `pid` has used so far; 0.0 once it is gone."""
    stat = _stat(pid)
    return stat[1] / TICKS_PER_S if stat else 0.0


def _name(pid: int) -> str | None:
    """`prefill-0` for `python -m pdrt.process prefill-0`; for another Python program its module or script
    (`transformers` for `python .../bin/transformers serve`); None for `python -c` (how multiprocessing
    starts its children); otherwise the program's base name."""
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    except OSError:
        return str(pid)
    args = [a.decode(errors="replace") for a in argv]
    program = Path(args[0]).name
    if not program.startswith("python"):
        return program
    if "-c" in args:
        return None
    if "pdrt.process" in args[:-1]:
        return args[args.index("pdrt.process") + 1]
    if "-m" in args[:-1]:
        return args[args.index("-m") + 1]
    script = next((a for a in args[1:] if not a.startswith("-")), None)
    return Path(script).name if script else program


class CpuMeter:
    """Samples the machine and every process of the trees under `roots` (a server's supervisor, this client);
    a process is named by `_name`, a nameless one after its tree's root ("transformers serve child")."""

    def __init__(self, roots: dict[int, str]) -> None:
        self.roots = roots  # pid -> name for the root process itself ("client"; children get their own names)
        self._start: _Sample | None = None

    @staticmethod
    def available() -> bool:
        return (PROC / "stat").exists()

    def _sample(self) -> _Sample:
        parents: dict[int, int] = {}
        ticks: dict[int, int] = {}
        for entry in PROC.iterdir():
            if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
                parents[int(entry.name)], ticks[int(entry.name)] = stat
        processes = {}
        for pid in ticks:
            ancestor = pid
            while ancestor not in self.roots and ancestor in parents and parents[ancestor] > 1:
                ancestor = parents[ancestor]
            if ancestor in self.roots:
                name = self.roots.get(pid) or _name(pid) or f"{self.roots[ancestor]} child"
                processes[pid] = (name, ticks[pid])
        return _Sample(time.monotonic(), *_machine_ticks(), processes)

    def start(self) -> None:
        self._start = self._sample() if self.available() else None

    def read(self) -> CpuUsage | None:
        """Cores used since `start()`, by process name (processes of one name summed; one that ended in the
        span is missing from its name's share, not from `busy`); None off Linux."""
        if self._start is None:
            return None
        end = self._sample()
        seconds = end.at - self._start.at
        if seconds <= 0:
            return None
        used: dict[str, float] = {}
        for pid, (name, ticks) in end.processes.items():
            before = self._start.processes.get(pid, (name, 0))[1]
            used[name] = used.get(name, 0.0) + (ticks - before) / TICKS_PER_S / seconds
        busy = (end.machine_busy - self._start.machine_busy) / TICKS_PER_S / seconds
        stolen = (end.machine_stolen - self._start.machine_stolen) / TICKS_PER_S / seconds
        return CpuUsage(os.cpu_count() or 1, seconds, busy, stolen, used)
