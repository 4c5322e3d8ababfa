"""A real node for tests and benchmarks: `pdrt up` in a subprocess, on free ports, stopped on exit."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

READY_PREFIX = "pdrt ready:"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


def write_config(path: Path, settings: dict) -> Path:
    """A TOML file from a dict of top-level keys and one level of tables."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in settings.items() if not isinstance(v, dict)]
    for table, values in settings.items():
        if isinstance(values, dict):
            lines.append(f"\n[{table}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


class Node:
    """`pdrt up --config <file>` running in its own process; `address` is its gateway."""

    def __init__(self, workdir: Path, model: str, mode: str = "disaggregated", transfer: str = "shm",
                 engine: dict | None = None, extra: dict | None = None, ready_timeout_s: float = 120.0) -> None:
        self.gateway_port, self.controller_port = free_port(), free_port()
        settings: dict = {"model": model, "mode": mode, "transfer": transfer,
                          "gateway": {"port": self.gateway_port, "http_port": free_port()},
                          "controller": {"port": self.controller_port, "metrics_port": free_port()},
                          "engine": {"kv_cache_bytes": 64 << 20, **(engine or {})}}
        for key, value in (extra or {}).items():
            if isinstance(value, dict):
                settings.setdefault(key, {}).update(value)
            else:
                settings[key] = value
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = write_config(workdir / f"node-{self.gateway_port}.toml", settings)
        self.log_path = workdir / f"node-{self.gateway_port}.log"
        self.address = f"tcp://127.0.0.1:{self.gateway_port}"
        self.ready_timeout_s = ready_timeout_s
        self.process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self.stdout_lines: list[str] = []

    def start(self) -> "Node":
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pdrt.cli", "up", "--config", str(self.config_path)],
                stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        ready = threading.Event()

        def read_stdout() -> None:
            assert self.process is not None and self.process.stdout is not None
            for line in self.process.stdout:
                self.stdout_lines.append(line)
                if line.startswith(READY_PREFIX):
                    ready.set()

        self._reader = threading.Thread(target=read_stdout, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + self.ready_timeout_s
        while not ready.wait(0.1):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pdrt up did not become ready; log: {self.log_path}\n{self.log_tail()}")
        return self

    @property
    def run_id(self) -> str:
        """The supervisor's run id (it names the run's shared-memory segments), read from its JSON log."""
        match = re.search(r'"run_id": "([0-9a-f]+)"', self.log_path.read_text())
        if match is None:
            raise RuntimeError(f"no run id in {self.log_path}")
        return match.group(1)

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text()[-num_chars:]

    def child_pids(self) -> dict[str, int]:
        """The pid of every process of the node, by name, read from /proc."""
        assert self.process is not None
        pids = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.process.pid and b"pdrt.process" in cmdline:
                pids[cmdline[cmdline.index(b"pdrt.process") + 1].decode()] = int(entry.name)
        return pids

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
        finally:
            if self._reader is not None:
                self._reader.join(timeout=2)  # it reaches the end of the pipe once the supervisor is gone
            if self.process.stdout is not None:
                self.process.stdout.close()

    def __enter__(self) -> "Node":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
