"""`pdrt up` in a process of its own, for as long as a command or a test needs it: the one node launcher.

`SpawnedServer(up_args)` runs `pdrt up UP_ARGS` and returns from `start()`
once the supervisor prints that the node is ready; `stop()` sends SIGTERM,
which lets the node drain and remove its shared memory, and kills it if it
does not stop in time. `SpawnedServer.at(address)` is the server that
`pdrt generate --serve` and `pdrt chat --serve` start for one command: in a
session of its own, so that a Ctrl-C meant for the command (to cancel an
answer) does not reach it, logging to a temporary file that is removed
after a clean exit. pdrt/testing/node.py builds test and benchmark nodes on
it from a config file.
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from pdrt.errors import ConfigError, UnavailableError

READY_PREFIX = "pdrt ready:"
STOP_TIMEOUT_S = 30.0


def split_tcp_address(address: str) -> tuple[str, int]:
    """("127.0.0.1", 7100) from "tcp://127.0.0.1:7100"; only TCP addresses name a port `pdrt up` can bind."""
    if not address.startswith("tcp://") or ":" not in address[len("tcp://"):]:
        raise ConfigError(f"expected a server address like tcp://127.0.0.1:7100, got {address!r}")
    host, port = address[len("tcp://"):].rsplit(":", 1)
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise ConfigError(f"the port of {address!r} is not a number") from None


def is_listening(address: str, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections at `address`: a refused connect answers at once, a handshake not."""
    host, port = split_tcp_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class SpawnedServer:
    """`pdrt up UP_ARGS` from `start()` until `stop()`; its stderr goes to `log_path` (a temporary file if None)."""

    def __init__(self, up_args: list[str], log_path: Path | None = None, ready_timeout_s: float = 300.0,
                 new_session: bool = False) -> None:
        self.up_args = up_args
        self.owns_log = log_path is None
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="pdrt-serve-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.new_session = new_session
        self.process: subprocess.Popen | None = None
        self.stdout_lines: list[str] = []
        self._reader: threading.Thread | None = None

    @classmethod
    def at(cls, address: str, model: str | None = None, ready_timeout_s: float = 300.0) -> "SpawnedServer":
        """A server on `address` for one command; its controller on a free port, so that one spawned next to
        another node never collides with it."""
        host, port = split_tcp_address(address)
        up_args = ["--host", host, "--port", str(port), "--controller-port", str(free_port(host)),
                   "--ready-timeout", str(ready_timeout_s)]
        return cls(up_args + (["--model", model] if model else []), ready_timeout_s=ready_timeout_s,
                   new_session=True)

    def start(self) -> "SpawnedServer":
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "pdrt.cli", "up", *self.up_args],
                                            stdout=subprocess.PIPE, stderr=log, text=True,
                                            start_new_session=self.new_session,
                                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
        ready = threading.Event()

        def read_stdout() -> None:  # drains stdout for the server's whole life, so it never blocks on a full pipe
            assert self.process is not None and self.process.stdout is not None
            for line in self.process.stdout:
                self.stdout_lines.append(line)
                if line.startswith(READY_PREFIX):
                    ready.set()

        self._reader = threading.Thread(target=read_stdout, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + self.ready_timeout_s
        try:
            while not ready.wait(0.1):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    why = f"exited with status {self.process.returncode}" if self.process.returncode is not None \
                        else f"was not ready within {self.ready_timeout_s:g} s"
                    raise UnavailableError(f"pdrt up {' '.join(self.up_args)} {why}; its log ({self.log_path}):\n"
                                           f"{self.log_tail()}")
        except BaseException:  # Ctrl-C included: never leave the server behind
            self.stop(keep_log=True)
            raise
        return self

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text()[-num_chars:]

    def stop(self, keep_log: bool = False, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM and wait (kill after `timeout_s`); the exit status, None when it never started.

        A temporary log is removed after a clean exit, and kept (its path printed) otherwise.
        """
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._reader is not None:
            self._reader.join(timeout=2)  # it reaches the end of the pipe once the supervisor is gone
        if self.process.stdout is not None:
            self.process.stdout.close()
        if self.owns_log:
            if self.process.returncode == 0 and not keep_log:
                self.log_path.unlink(missing_ok=True)
            else:
                print(f"pdrt: the server's log is in {self.log_path}", file=sys.stderr)
        return self.process.returncode

    def __enter__(self) -> "SpawnedServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
