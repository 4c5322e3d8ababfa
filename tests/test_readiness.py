"""Readiness of a node without a gateway: asked of a real controller process, by the check and by `pdrt up`.

Workers are stand-ins that register and heartbeat over the internal
protocol, as a real worker's controller link does (under the cluster key),
so no model loads.
"""

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdrt.actors.cluster_key import ClusterKey
from pdrt.node_config import ControllerConfig, GatewayConfig, NodeConfig, WorkerGroup
from pdrt.supervisor import Supervisor, new_run_id
from pdrt.supervisor.readiness import check_controller
from pdrt.testing.node import free_port

KEY = ClusterKey.generate()
STAND_IN = r"""
import signal, sys, time, uuid
import zmq
from pdrt import wire
from pdrt.actors.cluster_key import ClusterKey
name, address, key = sys.argv[1:4]
incarnation = uuid.uuid4().hex[:8]
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.IDENTITY, f"{name}.{incarnation}".encode())
ClusterKey(key.encode()).secure(sock, server=False)
sock.connect(address)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
sock.send(wire.encode(wire.Register(wire.PROTOCOL_VERSION, name, incarnation, "decode", "tcp://127.0.0.1:9")))
while not stop:
    sock.send(wire.encode(wire.Heartbeat(name, incarnation)))
    while sock.poll(0):
        sock.recv()
    time.sleep(0.1)
sock.send(wire.encode(wire.Goodbye(name, incarnation)))
sock.close(linger=200)
ctx.term()
"""


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A real controller process on a free port: its address, and the file its JSON-lines log goes to."""
    config = NodeConfig(model="unused", controller=ControllerConfig(port=free_port()), cluster_key=KEY.text)
    (tmp_path / "controller.json").write_bytes(config.to_json())
    log = tmp_path / "controller.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "pdrt.process", "controller"], stderr=stderr,
                                env=dict(os.environ, PDRT_NODE_CONFIG=str(tmp_path / "controller.json")))
    try:
        yield config.controller_address, log
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def stand_in(name: str, address: str) -> list[str]:
    return [sys.executable, "-c", STAND_IN, name, address, KEY.text]


def wait_for(check, timeout_s: float = 15.0) -> str | None:
    deadline = time.monotonic() + timeout_s
    while (problem := check()) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    return problem


def log_events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def test_the_controller_check_names_the_workers_it_does_not_list_then_passes_once_they_register(controller):
    address, log = controller
    def answered() -> str | None:
        problem = check_controller(address, ["decode-b-0"], "probe-t", KEY)
        return problem if problem and "did not answer" in problem else None

    assert wait_for(answered) is None  # the controller process is up
    assert check_controller(address, ["decode-b-0"], "probe-t", None) == "the controller did not answer"
    assert check_controller(address, ["decode-b-0"], "probe-t", KEY) == (
        f"workers not registered with the controller at {address}: decode-b-0")

    proc = subprocess.Popen(stand_in("decode-b-0", address))
    try:
        assert wait_for(lambda: check_controller(address, ["decode-b-0"], "probe-t", KEY)) is None
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    events = log_events(log)
    # The probe registered as a gateway, and left at once.
    assert any(e["event"] == "process registered" and e["process"] == "probe-t" and e["role"] == "gateway"
               for e in events)
    assert any(e["event"] == "process left" and e["process"] == "probe-t" for e in events)


def test_the_controller_check_says_when_nobody_answers():
    problem = check_controller(f"tcp://127.0.0.1:{free_port()}", ["decode-0"], "probe-t", KEY, timeout_s=0.2)
    assert problem == "the controller did not answer"


def test_a_node_of_decode_workers_is_ready_once_the_remote_controller_lists_them(controller, capsys):
    address, _ = controller
    port = int(address.rsplit(":", 1)[1])
    config = NodeConfig(model="unused", node="b", cluster_key=KEY.text,
                        controller=ControllerConfig(port=port, enabled=False),
                        gateway=GatewayConfig(enabled=False), prefill=WorkerGroup(count=0),
                        decode=WorkerGroup(count=2))
    supervisor = Supervisor(config, new_run_id(), command_for=lambda name: stand_in(name, address),
                            ready_timeout_s=30.0)
    stopper = threading.Thread(target=lambda: (wait_for(lambda: None if supervisor.is_ready else "no", 30.0),
                                               supervisor.request_stop()))
    stopper.start()
    try:
        assert supervisor.run() == 0
    finally:
        supervisor.request_stop()
        stopper.join()

    assert supervisor.is_ready
    ready = f"pdrt ready: 2 workers registered with {address} (disaggregated)"
    assert ready in capsys.readouterr().out.splitlines()
