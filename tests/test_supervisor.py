"""The `pdrt up` supervisor, over real child processes: small Python scripts stand in for pdrt.process.

Each stand-in logs its start (and what it found in /dev/shm and the config
JSON) and any SIGTERM it gets to a JSON-lines file, and creates a segment
`/dev/shm/pdrt-<run_id>-<name>-<pid>` as a real worker would. The supervisor
runs in the test process (stopped by `request_stop` from a timer thread), or
in a forked child when a test signals or kills it.
"""

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from pdrt import wire
from pdrt.node_config import GatewayConfig, NodeConfig, load_node_config
from pdrt.supervisor import RestartPolicy, Supervisor, add_arguments, config_overrides, leftovers, new_run_id

CHILD = r"""
import json, os, signal, sys, time
name, log_path, behaviour = sys.argv[1:4]
prefix = "pdrt-%s-%s-" % (os.environ["PDRT_RUN_ID"], name)
leftover = sorted(f for f in os.listdir("/dev/shm") if f.startswith(prefix))
mode = json.load(open(os.environ["PDRT_NODE_CONFIG"])).get("mode", "disaggregated")

def record(event):
    with open(log_path, "a") as f:
        f.write(json.dumps(dict(name=name, pid=os.getpid(), event=event, t=time.monotonic(), leftover=leftover,
                                mode=mode)) + "\n")

def on_term(signum, frame):
    record("sigterm")
    if behaviour != "stubborn":
        sys.exit(0)

signal.signal(signal.SIGTERM, on_term)
open("/dev/shm/" + prefix + str(os.getpid()), "w").close()
record("start")
if behaviour == "served-crash":  # got as far as serving, as pdrt.process marks it, then crashed
    with open(os.path.join(os.environ["PDRT_RUN_DIR"], name + ".serving"), "w") as f:
        f.write(os.environ["PDRT_INCARNATION"])
if behaviour in ("crash", "served-crash"):
    time.sleep(0.05)
    sys.exit(1)
if behaviour.startswith("live:"):
    time.sleep(float(behaviour[5:]))
    sys.exit(3)
while True:
    time.sleep(0.1)
"""

FAST = RestartPolicy(first_backoff_s=0.1, max_backoff_s=0.4, stable_after_s=30.0, max_startup_crashes=100)


@pytest.fixture
def events(tmp_path: Path) -> Path:
    return tmp_path / "events.jsonl"


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def commands(log_path: Path, behaviours: dict[str, str] | None = None) -> Callable[[str], list[str]]:
    """Every process a sleeper unless `behaviours` says "crash", "served-crash", "stubborn" or "live:<seconds>"."""
    return lambda name: [sys.executable, "-c", CHILD, name, str(log_path), (behaviours or {}).get(name, "sleep")]


def make_supervisor(config: NodeConfig, log_path: Path, behaviours: dict[str, str] | None = None,
                    **kwargs) -> Supervisor:
    kwargs.setdefault("ready_timeout_s", None)
    return Supervisor(config, new_run_id(), command_for=commands(log_path, behaviours), **kwargs)


def run_for(supervisor: Supervisor, seconds: float) -> int:
    timer = threading.Timer(seconds, supervisor.request_stop)
    timer.start()
    try:
        return supervisor.run()
    finally:
        timer.cancel()


def run_until(supervisor: Supervisor, done, timeout_s: float = 20.0) -> int:
    """Run until `done()` holds (checked every 50 ms) or `timeout_s` passes: a loaded machine starts
    Python processes slowly, so a fixed run time would count too few restarts."""
    stop = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while not stop.wait(0.05) and not done() and time.monotonic() < deadline:
            pass
        supervisor.request_stop()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        return supervisor.run()
    finally:
        stop.set()
        watcher.join()


def is_alive(pid: int) -> bool:
    """Exists and is not a zombie (an orphan waiting for init to reap it counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def remains(run_id: str) -> list[str]:
    shm = [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(f"pdrt-{run_id}")]  # and its .lock
    run_dirs = [p.name for p in Path(tempfile.gettempdir()).glob(f"pdrt-{run_id}-*")]
    return shm + run_dirs


def segments_of(run_id: str) -> list[str]:
    """The run's segments, without its lock file."""
    return [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(f"pdrt-{run_id}-")]


def assert_nothing_left(log_path: Path, run_id: str) -> None:
    pids = {e["pid"] for e in read_events(log_path)}
    deadline = time.monotonic() + 5
    while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in pids if is_alive(pid)] == []
    assert remains(run_id) == []


def starts(log_path: Path, name: str) -> list[dict]:
    return [e for e in read_events(log_path) if e["name"] == name and e["event"] == "start"]


# -- forked supervisors ---------------------------------------------------------


def fork_supervisor(supervisor: Supervisor, own_group: bool = False) -> int:
    """Run `supervisor` in a forked child (cheaper than a fresh interpreter importing torch)."""
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            if own_group:
                os.setpgid(0, 0)
            code = supervisor.run()
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def wait_exit(pid: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"supervisor {pid} still running after {timeout_s} s")


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def all_started(log_path: Path, config: NodeConfig) -> Callable[[], bool]:
    return lambda: {e["name"] for e in read_events(log_path) if e["event"] == "start"} >= set(config.process_names())


# -- restarts --------------------------------------------------------------------


def test_crashed_process_restarts_with_growing_backoff_after_its_segments_are_removed(events: Path):
    config = NodeConfig(model="unused", mode="colocated")
    supervisor = make_supervisor(config, events, {"colocated-0": "crash"}, policy=FAST)

    assert run_until(supervisor, lambda: len(starts(events, "colocated-0")) >= 4) == 0

    crashes = starts(events, "colocated-0")
    assert len(crashes) >= 4
    assert all(e["leftover"] == [] for e in crashes)  # the crashed incarnation's segment was gone before restart
    assert all(e["mode"] == "colocated" for e in crashes)  # children read the resolved config JSON
    gaps = [b["t"] - a["t"] for a, b in zip(crashes, crashes[1:], strict=False)]
    for gap, backoff in zip(gaps, [0.1, 0.2, 0.4, 0.4], strict=False):
        assert gap >= backoff + 0.05  # the child lives 0.05 s, then waits out its backoff
    assert len(starts(events, "controller")) == len(starts(events, "gateway")) == 1
    assert supervisor.failure is None
    assert_nothing_left(events, supervisor.run_id)


def test_gives_up_when_a_process_keeps_crashing_at_startup(events: Path):
    config = NodeConfig(model="unused", mode="colocated")
    policy = RestartPolicy(first_backoff_s=0.05, max_backoff_s=0.1, max_startup_crashes=3)
    supervisor = make_supervisor(config, events, {"colocated-0": "crash"}, policy=policy)

    assert run_for(supervisor, 15.0) == 1

    assert len(starts(events, "colocated-0")) == 3
    assert "colocated-0" in supervisor.failure and "giving up" in supervisor.failure
    assert_nothing_left(events, supervisor.run_id)


@pytest.mark.parametrize(("behaviour", "stable_after_s"), [
    ("live:0.4", 0.3),  # stayed up past the stable period
    ("served-crash", 30.0),  # served, then crashed at once: what a request does to a worker never stops the node
])
def test_a_process_that_stayed_up_long_enough_or_served_is_not_counted_as_a_startup_crash(events: Path, behaviour,
                                                                                          stable_after_s):
    config = NodeConfig(model="unused", mode="colocated")
    policy = RestartPolicy(first_backoff_s=0.05, max_backoff_s=0.1, stable_after_s=stable_after_s,
                           max_startup_crashes=2)
    supervisor = make_supervisor(config, events, {"colocated-0": behaviour}, policy=policy)

    assert run_until(supervisor, lambda: len(starts(events, "colocated-0")) >= 4) == 0

    assert len(starts(events, "colocated-0")) >= 4
    assert supervisor.failure is None
    assert_nothing_left(events, supervisor.run_id)


# -- stopping ----------------------------------------------------------------------


def test_sigterm_stops_gateway_then_workers_then_controller_and_leaves_nothing_behind(events: Path):
    config = NodeConfig(model="unused", mode="disaggregated")
    supervisor = make_supervisor(config, events)
    pid = fork_supervisor(supervisor)
    wait_until(all_started(events, config))
    assert supervisor.run_id not in leftovers.sweep_dead_runs()  # a live run's lock keeps its segments
    assert len(segments_of(supervisor.run_id)) == len(config.process_names())

    os.kill(pid, signal.SIGTERM)

    assert wait_exit(pid, 10) == 0
    terms = {e["name"]: e["t"] for e in read_events(events) if e["event"] == "sigterm"}
    assert set(terms) == set(config.process_names())
    assert terms["gateway"] < min(terms["prefill-0"], terms["decode-0"])
    assert max(terms["prefill-0"], terms["decode-0"]) < terms["controller"]
    assert_nothing_left(events, supervisor.run_id)


def test_ctrl_c_drains_once_and_a_second_one_kills_everything_at_once(events: Path):
    config = NodeConfig(model="unused", mode="disaggregated")
    supervisor = make_supervisor(config, events, dict.fromkeys(config.process_names(), "stubborn"),
                                 stop_timeout_s=30.0)
    pid = fork_supervisor(supervisor, own_group=True)
    wait_until(all_started(events, config))

    os.killpg(pid, signal.SIGINT)  # what a terminal does on Ctrl-C: the whole foreground group
    wait_until(lambda: any(e["event"] == "sigterm" for e in read_events(events)))
    time.sleep(0.3)
    # Only the gateway was asked to stop; the children, in their own groups, never saw the SIGINT.
    assert [e["name"] for e in read_events(events) if e["event"] == "sigterm"] == ["gateway"]
    assert all(is_alive(e["pid"]) for e in read_events(events) if e["event"] == "start")

    began = time.monotonic()
    os.killpg(pid, signal.SIGINT)
    assert wait_exit(pid, 10) == 0
    assert time.monotonic() - began < 5  # not the 40 s the gateway's drain and stop timeouts would allow
    assert_nothing_left(events, supervisor.run_id)


def test_sigkill_of_the_supervisor_takes_its_children_down_and_the_next_run_cleans_up(events: Path, tmp_path: Path):
    config = NodeConfig(model="unused", mode="disaggregated")
    supervisor = make_supervisor(config, events)
    pid = fork_supervisor(supervisor)
    wait_until(all_started(events, config))

    os.kill(pid, signal.SIGKILL)

    assert wait_exit(pid, 5) == -signal.SIGKILL
    pids = {e["pid"] for e in read_events(events)}
    wait_until(lambda: not any(is_alive(p) for p in pids), timeout_s=5)
    assert len(segments_of(supervisor.run_id)) == len(config.process_names())
    assert len(remains(supervisor.run_id)) > len(segments_of(supervisor.run_id))  # the lock and run directory

    following = make_supervisor(NodeConfig(model="unused", mode="colocated"), tmp_path / "following.jsonl")
    assert run_for(following, 0.2) == 0
    assert remains(supervisor.run_id) == []


# -- readiness ------------------------------------------------------------------------


class FakeGateway:
    """A ROUTER that answers Hello and GetStatus as the gateway does, with the workers it is told are alive."""

    def __init__(self, alive: dict[str, bool]) -> None:
        self.alive = alive
        self.on_full_status: Callable[[], None] = lambda: None
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.port = int(self.sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            if not self.sock.poll(20):
                continue
            identity, frame = self.sock.recv_multipart()
            request = wire.client_request_decoder.decode(frame)
            if isinstance(request, wire.Hello):
                reply = wire.Ready(wire.PROTOCOL_VERSION, server="fake", model="m", max_model_len=64)
            else:
                workers = [wire.WorkerStatus(name, name.split("-")[0], alive, wire.Load())
                           for name, alive in self.alive.items()]
                reply = wire.Status(workers)
            self.sock.send_multipart([identity, wire.encode(reply)])
            if isinstance(reply, wire.Status) and all(self.alive.values()):
                self.on_full_status()
        self.sock.close()

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.ctx.term()


@pytest.fixture
def fake_gateway() -> Iterator[Callable[[dict[str, bool]], FakeGateway]]:
    made: list[FakeGateway] = []

    def make(alive: dict[str, bool]) -> FakeGateway:
        made.append(FakeGateway(alive))
        return made[-1]

    yield make
    for gateway in made:
        gateway.close()


def test_prints_ready_once_the_gateway_reports_every_worker_alive(events: Path, fake_gateway, capsys):
    gateway = fake_gateway({"prefill-0": True, "decode-0": True})
    config = NodeConfig(model="unused", mode="disaggregated", gateway=GatewayConfig(port=gateway.port))
    supervisor = make_supervisor(config, events, ready_timeout_s=10.0, preflight=False)  # its port is the fake's
    gateway.on_full_status = supervisor.request_stop

    assert run_for(supervisor, 15.0) == 0

    assert supervisor.is_ready
    ready_line = f"pdrt ready: tcp://127.0.0.1:{gateway.port} (disaggregated, 2 workers)"
    assert ready_line in capsys.readouterr().out.splitlines()
    assert_nothing_left(events, supervisor.run_id)


def test_readiness_timeout_names_the_workers_that_never_became_ready(events: Path, fake_gateway):
    gateway = fake_gateway({"prefill-0": True, "decode-0": False})
    config = NodeConfig(model="unused", mode="disaggregated", gateway=GatewayConfig(port=gateway.port))
    supervisor = make_supervisor(config, events, ready_timeout_s=1.0, preflight=False)

    assert run_for(supervisor, 15.0) == 1

    assert not supervisor.is_ready
    assert "decode-0" in supervisor.failure and "prefill-0" not in supervisor.failure
    assert_nothing_left(events, supervisor.run_id)


# -- flags -------------------------------------------------------------------------------


def test_flags_override_the_config_file_and_environment(tmp_path: Path):
    toml = tmp_path / "node.toml"
    toml.write_text('model = "/from/file"\n[gateway]\nport = 7000\n[engine]\nkv_cache_bytes = 5\n')
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--config", str(toml), "--colocated", "--port", "8000", "--controller-port", "8001",
                              "--kv-cache-bytes", "1000", "--prefill-chunk", "64", "--transfer", "tcp",
                              "--host", "0.0.0.0", "--model", "/from/flag"])

    config = load_node_config(args.config, config_overrides(args), environ={"PDRT_PORT": "7500"})

    assert (config.model, config.mode, config.host, config.transfer) == ("/from/flag", "colocated", "0.0.0.0", "tcp")
    assert (config.gateway.port, config.controller.port) == (8000, 8001)
    assert (config.engine.kv_cache_bytes, config.engine.max_prefill_chunk_size) == (1000, 64)
    assert args.ready_timeout == 300.0


def test_flags_not_given_leave_file_and_environment_alone(tmp_path: Path):
    toml = tmp_path / "node.toml"
    toml.write_text('model = "/from/file"\nmode = "disaggregated"\n[engine]\nkv_cache_bytes = 5\n')
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--config", str(toml)])

    config = load_node_config(args.config, config_overrides(args), environ={"PDRT_PORT": "7500"})

    assert (config.model, config.mode, config.gateway.port, config.engine.kv_cache_bytes) == (
        "/from/file", "disaggregated", 7500, 5)
