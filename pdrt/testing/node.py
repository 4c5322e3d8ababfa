"""A real node for tests and benchmarks: `pdrt up` from a config file, on free ports, stopped on exit."""

import re
from pathlib import Path

from pdrt.client.spawned_server import SpawnedServer, free_port

__all__ = ["Node", "free_port", "write_config"]


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, dict):  # an inline table
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def write_config(path: Path, settings: dict) -> Path:
    """A TOML file from a dict of top-level keys and one level of tables (deeper dicts: inline tables)."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in settings.items() if not isinstance(v, dict)]
    for table, values in settings.items():
        if isinstance(values, dict):
            lines.append(f"\n[{table}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


class Node(SpawnedServer):
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
        self.address = f"tcp://127.0.0.1:{self.gateway_port}"
        super().__init__(["--config", str(self.config_path)], log_path=workdir / f"node-{self.gateway_port}.log",
                         ready_timeout_s=ready_timeout_s)

    @property
    def run_id(self) -> str:
        """The supervisor's run id (it names the run's shared-memory segments), read from its JSON log."""
        match = re.search(r'"run_id": "([0-9a-f]+)"', self.log_path.read_text())
        if match is None:
            raise RuntimeError(f"no run id in {self.log_path}")
        return match.group(1)

    def role_changes_ms(self) -> list[float]:
        """Decision-to-serving times of the role changes its controller logged, in order."""
        lines = [line for line in self.log_path.read_text().splitlines() if '"event": "role changed"' in line]
        return [1e3 * float(m.group(1)) for m in map(re.compile(r'"seconds": ([0-9.e-]+)').search, lines) if m]

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
