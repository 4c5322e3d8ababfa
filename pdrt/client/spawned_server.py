"""A `pdrt up` started for the length of one command (`pdrt generate --serve`, `pdrt chat --serve`).

The node runs in its own session, so that a Ctrl-C meant for the command (to
cancel an answer) does not reach the server; the command stops it with
SIGTERM, which lets it drain and remove its shared memory, when it exits.
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


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class SpawnedServer:
    """`pdrt up` serving `address` (with `model` when given) from `start()` until `stop()`."""

    def __init__(self, address: str, model: str | None = None, ready_timeout_s: float = 300.0) -> None:
        self.address = address
        self.model = model
        self.ready_timeout_s = ready_timeout_s
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None

    def command(self) -> list[str]:
        host, port = split_tcp_address(self.address)
        # The controller port is picked free, so a server spawned next to another node never collides with it.
        cmd = [sys.executable, "-m", "pdrt.cli", "up", "--host", host, "--port", str(port),
               "--controller-port", str(_free_port(host)), "--ready-timeout", str(self.ready_timeout_s)]
        return cmd + (["--model", self.model] if self.model else [])

    def start(self) -> "SpawnedServer":
        fd, log_name = tempfile.mkstemp(prefix="pdrt-serve-", suffix=".log")
        self.log_path = Path(log_name)
        print(f"pdrt: no server at {self.address}; starting one (log: {self.log_path})", file=sys.stderr)
        with os.fdopen(fd, "w") as log:
            self.process = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=log, text=True,
                                            start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        ready = threading.Event()

        def read_stdout() -> None:  # drains stdout for the server's whole life, so it never blocks on a full pipe
            assert self.process is not None and self.process.stdout is not None
            for line in self.process.stdout:
                if line.startswith(READY_PREFIX):
                    ready.set()

        threading.Thread(target=read_stdout, daemon=True).start()
        deadline = time.monotonic() + self.ready_timeout_s
        try:
            while not ready.wait(0.1):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise UnavailableError(f"the server started for {self.address} did not become ready "
                                           f"within {self.ready_timeout_s:g} s; its log:\n{self.log_tail()}")
        except BaseException:  # Ctrl-C included: never leave the server behind
            self.stop(keep_log=True)
            raise
        return self

    def log_tail(self, num_chars: int = 2000) -> str:
        return self.log_path.read_text()[-num_chars:] if self.log_path is not None else ""

    def stop(self, keep_log: bool = False) -> int | None:
        """SIGTERM and wait (kill after STOP_TIMEOUT_S); the exit status, None when it never started.

        The log is removed after a clean exit and kept (its path printed) otherwise.
        """
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.log_path is not None:
            if self.process.returncode == 0 and not keep_log:
                self.log_path.unlink(missing_ok=True)
            else:
                print(f"pdrt: the server's log is in {self.log_path}", file=sys.stderr)
        return self.process.returncode

    def __enter__(self) -> "SpawnedServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
