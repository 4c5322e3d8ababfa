"""A minimal raw client for system tests: speaks pdrt.wire directly, so the tests check the protocol itself."""

import os
import signal
import time
import urllib.request
from pathlib import Path

import msgspec
import zmq

from pdrt.engine.sampling_params import SamplingParams
from pdrt.metrics.exposition import parse
from pdrt.wire import (
    PROTOCOL_VERSION,
    Error,
    Generate,
    GetStatus,
    Hello,
    Ready,
    Status,
    Tokens,
    client_reply_decoder,
    encode,
)


class RawClient:
    def __init__(self, address: str, handshake: bool = True) -> None:
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        if handshake:
            assert isinstance(self.ask(Hello(PROTOCOL_VERSION)), Ready)

    def send(self, message: msgspec.Struct | bytes) -> None:
        self.socket.send(message if isinstance(message, bytes) else encode(message))

    def recv(self, timeout_s: float = 30.0):
        if not self.socket.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no reply in {timeout_s} s")
        return client_reply_decoder.decode(self.socket.recv())

    def ask(self, message: msgspec.Struct | bytes, timeout_s: float = 30.0):
        self.send(message)
        return self.recv(timeout_s)

    def generate_many(self, prompts: list[list[int]], params: SamplingParams, stream: bool = True,
                      timeout_s: float = 120.0) -> dict[str, list[int] | Error]:
        """Send every prompt at once; collect each request's tokens (or its error) until all ended."""
        for i, prompt in enumerate(prompts):
            self.send(Generate(f"r{i}", token_ids=prompt, params=params, stream=stream))
        results: dict[str, list[int] | Error] = {}
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        deadline = time.monotonic() + timeout_s
        while len(results) < len(prompts):
            reply = self.recv(max(0.1, deadline - time.monotonic()))
            if isinstance(reply, Error):
                results[reply.request_id] = reply
            elif isinstance(reply, Tokens):
                tokens[reply.request_id].extend(reply.token_ids)
                if reply.finished:
                    results[reply.request_id] = tokens[reply.request_id]
        return {f"r{i}": results[f"r{i}"] for i in range(len(prompts))}

    def close(self) -> None:
        self.socket.close()
        self.ctx.term()


def node_status(node) -> Status:
    """The gateway's status, asked on a connection of its own (streams may be open on others)."""
    client = RawClient(node.address)
    try:
        status = client.ask(GetStatus())
    finally:
        client.close()
    assert isinstance(status, Status)
    return status


def used_blocks(node) -> dict[str, int]:
    """KV blocks in use per live worker (loads arrive with heartbeats: a quarter second late)."""
    return {w.process_id: w.load.num_used_blocks for w in node_status(node).workers}


def scrape(node) -> tuple[str, list]:
    """The controller's merged metrics, as text and parsed, from a node started with `node.metrics_url` set."""
    with urllib.request.urlopen(node.metrics_url, timeout=5) as reply:
        text = reply.read().decode()
    return text, parse(text.encode())


def wait_for(predicate, timeout_s: float, interval_s: float = 0.05):
    """Poll `predicate` until it returns something true (returned), or fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s} s")


def default_sigint() -> None:
    """A Popen preexec_fn: Ctrl-C's default action in the child, even where this run ignores SIGINT.

    A shell starts a background job (`pytest &`) with SIGINT ignored, its children inherit that, and
    Python then installs no KeyboardInterrupt handler: a test's SIGINT would do nothing.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def niceness(pid: int) -> set[int]:
    """The niceness of every thread of process `pid` (Linux keeps one per thread)."""
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return {int((task / "stat").read_text().rsplit(")", 1)[1].split()[16]) for task in tasks}


def allowed_cpus(pid: int) -> set[frozenset[int]]:
    """The cores each thread of process `pid` may run on (Linux keeps an affinity per thread)."""
    return {frozenset(os.sched_getaffinity(int(task.name))) for task in Path(f"/proc/{pid}/task").iterdir()}
