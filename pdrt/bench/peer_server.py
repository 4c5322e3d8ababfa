"""A peer that serves the OpenAI API in a process of its own, for the benchmarks: started, awaited, stopped."""

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from pdrt.bench.driver import Target
from pdrt.client.spawned_server import free_port


class PeerServer:
    """A server started by `command()` on a free port, in a session of its own, its output in `log_path`; the
    model is served under its path."""

    process_name = "peer"
    start_timeout_s = 180.0

    def __init__(self, workdir: Path, model: str, log_name: str) -> None:
        self.port = free_port()
        self.model = model
        self.log_path = workdir / f"{log_name}-{self.port}.log"
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str] | None:
        return None  # this process's

    def start(self) -> "PeerServer":
        """Start it and wait until it lists its models, at most `start_timeout_s`."""
        with open(self.log_path, "w") as out:
            self.process = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                            env=self.environment(), start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.process_name} exited with status {self.process.returncode}; "
                                   f"log: {self.log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.process_name} did not answer in {self.start_timeout_s:.0f} s; "
                           f"log: {self.log_path}")

    def target(self, protocol: str = "http") -> Target:
        return Target(f"http://127.0.0.1:{self.port}/v1", model=self.model)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def stop(self) -> None:
        """SIGTERM to its process group (the server and any process it started), SIGKILL after 30 s."""
        if self.process is None or self.process.poll() is not None:
            return
        try:  # the group outlives a leader that died first, while its children run on
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
