"""One supervised process: how it is spawned, signalled and reaped, and when it may be restarted.

Every child is spawned so that it cannot outlive the supervisor: it asks the
kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG, Linux only), so a
`kill -9` of `pdrt up` leaves no orphaned workers holding ports, GPU memory or
shared-memory pools. Each child also leads its own process group, so that a
Ctrl-C typed at the terminal (sent to the whole foreground group) reaches only
the supervisor, which then stops the children once and in order instead of
every process reacting to the same SIGINT at the same time.
"""

import ctypes
import os
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Exponential backoff between restarts, reset by `stable_after_s` of uptime; `max_startup_crashes` in a row
    of a process that never served (and never stayed up that long) end in giving up."""

    first_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    stable_after_s: float = 30.0
    max_startup_crashes: int = 5


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Looked up once here: the code that runs between fork and exec should do as little as possible.
_prctl = _load_prctl()


def _die_with_parent(parent_pid: int):
    """A preexec_fn: SIGKILL this child when the thread that spawned it exits.

    The signal follows the spawning *thread*, so children must be spawned from
    the supervisor's main thread (they are). Checking the parent after prctl
    closes the race where the supervisor died between fork and prctl.
    """

    def preexec() -> None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec if _prctl is not None else None


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class Child:
    """A named process, its current incarnation (if any) and its restart bookkeeping."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], policy: RestartPolicy) -> None:
        self.name = name
        self.command = command
        self.env = env
        self.policy = policy
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.num_starts = 0
        self.num_startup_crashes = 0
        self.backoff_s = policy.first_backoff_s
        self.restart_at: float | None = None
        self.incarnation = ""  # of the running (or last) start: the controller knows the process by it

    @property
    def is_running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self, now: float) -> None:
        # stdout goes to the supervisor's stderr: the supervisor's own stdout carries only the "ready" line.
        self.incarnation = secrets.token_hex(4)
        self.proc = subprocess.Popen(self.command, env={**self.env, "PDRT_INCARNATION": self.incarnation},
                                     stdin=subprocess.DEVNULL, stdout=2, process_group=0,
                                     preexec_fn=_die_with_parent(os.getpid()))
        self.started_at = now
        self.num_starts += 1
        self.restart_at = None

    def poll(self) -> int | None:
        """The exit status once the running incarnation has exited (and been reaped), else None."""
        return None if self.proc is None else self.proc.poll()

    def schedule_restart(self, now: float, served: bool = False) -> float | None:
        """After an unexpected exit: the delay before the next start, or None to give up. A process that `served`
        got past everything that can stop it from starting: it crashed on what it was given, and starts again."""
        stable = now - self.started_at >= self.policy.stable_after_s
        if stable:
            self.backoff_s = self.policy.first_backoff_s
        if stable or served:
            self.num_startup_crashes = 0
        else:
            self.num_startup_crashes += 1
            if self.num_startup_crashes >= self.policy.max_startup_crashes:
                return None
        delay = self.backoff_s
        self.backoff_s = min(self.backoff_s * 2, self.policy.max_backoff_s)
        self.restart_at = now + delay
        return delay

    def is_restart_due(self, now: float) -> bool:
        return self.restart_at is not None and now >= self.restart_at

    def terminate(self) -> None:
        """SIGTERM to the process alone: it drains and stops its own helpers."""
        if self.is_running:
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL to the whole process group, so helpers the child started go too."""
        if self.is_running:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()

    def reap(self, timeout_s: float) -> bool:
        """Wait for the exit status (no zombie left behind); False if the process would not die in time."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
