"""Hostile input for every port of a running node, and an account of what it did: the fuzz suite and bench_fuzz.

`Fuzzer(node, key, seed)` throws inputs at each port a node opens:

* the client ROUTER: random bytes, several frames at once, frames of known
  tags with fields of random types and values (huge integers, deep nesting,
  long strings, floats like 5e-324), on connections that did and did not say
  `Hello`, and well-formed short requests cancelled at random moments;
* the HTTP front: random and malformed JSON bodies on every route;
* the UDP warmup port: random datagrams, and well-formed ones with a bad MAC;
* the controller, the gateway's inbox, every worker's inbox and each prefill
  worker's KV server: the same kinds of frames, from sockets without the
  cluster key, with another key, and with the key under the identities of
  the node's own roles (hostile insiders: malformed messages, unknown ids,
  pulls of blocks that were never exported).

Valid but hostile requests go to the client port too (`valid_hostile`):
every field at its limit, floods of drafts, warmups, chat sessions,
continuations and handshakes, and cancels that cross a request's handoff.
Each must end with its tokens or a typed refusal.

Meanwhile `Sentinel`, a well-behaved client, sends greedy streams and
compares every answer with the same request sent before the fuzzing began,
and notes the longest wait between two frames of a stream (a stall).
`FuzzReport` counts what matters: processes that restarted (crashes),
requests that never ended (hangs: the sentinel's and the fuzzer's own
well-formed ones, and HTTP requests left without a response), the
sentinel's requests that failed or changed (lost), handshakes that succeeded
without the key (unauthenticated_accepted), HTTP 5xx answers, and the growth
of the node's resident memory.

Long because every port's driver is here, so that the test and the benchmark share them.
"""

import json
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from pdrt.actors.cluster_key import ClusterKey
from pdrt.actors.sockets import SocketSpec, make_socket
from pdrt.engine.sampling_params import SamplingParams
from pdrt.supervisor.readiness import cluster_view
from pdrt.testing.hostile_requests import HostileClient
from pdrt.testing.node import Node
from pdrt.warmup.datagram import sign
from pdrt.wire import (
    PROTOCOL_VERSION,
    Cancel,
    Error,
    Generate,
    Hello,
    InternalMessage,
    KVPullRequest,
    Tokens,
    client_reply_decoder,
    encode,
)

CLIENT_TAGS = ["hello", "generate", "cancel", "get_status", "draft_open", "draft_append", "draft_replace",
               "draft_submit", "draft_abandon", "warmup"]
# Every internal message the wire knows, so that a message added to it is fuzzed from then on.
INTERNAL_TAGS = [t.__struct_config__.tag for t in get_args(InternalMessage)]
KV_TAGS = ["kv_pull", "kv_pull_reply"]
HTTP_ROUTES = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
               ("POST", "/v1/pdrt/drafts"), ("PUT", "/v1/pdrt/drafts/x"), ("POST", "/v1/pdrt/drafts/x/submit"),
               ("DELETE", "/v1/pdrt/drafts/x"), ("POST", "/v1/pdrt/warmup"), ("GET", "/health"), ("GET", "/metrics"),
               ("GET", "/"), ("GET", "/static/../../../etc/passwd")]
HTTP_FIELDS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "seed", "stream", "stop",
               "n", "ignore_eos", "session_id", "text", "logprobs", "stream_options"]
REPLY_TIMEOUT_S = 30.0
HANDSHAKE_WAIT_S = 1.0
SENTINEL_PARAMS = SamplingParams(temperature=0.0, max_tokens=8)


def random_value(rng: random.Random, depth: int = 0) -> object:
    """A value of a random msgpack type, extremes included."""
    kind = rng.randrange(12 if depth < 3 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, 1, -1, 7, 2**31 - 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, rng.randrange(-9, 10**6)])
    if kind == 3:
        return rng.choice([0.0, -0.0, 5e-324, 1e308, float("inf"), float("nan"), rng.random() * 3])
    if kind == 4:
        return "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(rng.randrange(12)))
    if kind == 5:
        return rng.choice(["", "gateway", "decode-0", "prefill-0", "tcp://127.0.0.1:1", "x" * 70_000])
    if kind == 6:
        return rng.randbytes(rng.randrange(16))
    if kind == 7:
        return [rng.randrange(50) for _ in range(rng.randrange(40))]
    if kind in (8, 9):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(6))]
    return {str(random_value(rng, 3)): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def hostile_frame(rng: random.Random, tags: list[str]) -> bytes:
    """One frame a careless or hostile peer might send to a socket that speaks the tags `tags`."""
    kind = rng.randrange(6)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 200))
    structured = msgspec.msgpack.encode([rng.choice(tags), *(random_value(rng) for _ in range(rng.randrange(9)))])
    if kind == 1:
        return structured[: rng.randrange(1, max(2, len(structured)))]
    if kind == 2:
        depth = rng.choice([100, 10_000, 100_000])
        return msgspec.msgpack.encode([rng.choice(tags), "deep"])[:-5] + b"\x91" * depth + b"\xc0"
    return structured


@dataclass
class FuzzReport:
    inputs: int = 0
    crashes: int = 0
    hangs: int = 0
    lost: int = 0
    unauthenticated_accepted: int = 0
    server_errors: int = 0
    sentinel_requests: int = 0
    undelivered: int = 0  # an insider's frames that found no connection (the handshake took too long)
    rss_growth_mb: float = 0.0
    rss_growth_by_process: dict[str, float] = field(default_factory=dict)
    per_port: dict[str, int] = field(default_factory=dict)
    valid_hostile: int = 0  # valid requests at their limits, and floods
    refusals: dict[str, int] = field(default_factory=dict)  # what they were answered, by error code
    stall_max_ms: float = 0.0  # the longest wait between two frames of a sentinel stream
    first_frame_max_ms: float = 0.0  # and for its first frame

    def line(self) -> str:
        return (f"fuzz inputs={self.inputs} crashes={self.crashes} hangs={self.hangs} lost={self.lost} "
                f"unauthenticated_accepted={self.unauthenticated_accepted} rss_growth_mb={self.rss_growth_mb:.0f} "
                f"stall_max_ms={self.stall_max_ms:.0f} valid_hostile={self.valid_hostile}")


def rss_mb(pids: dict[str, int]) -> dict[str, float]:
    """Each process's resident memory in MiB (0 for one that is gone)."""
    sizes = {}
    for name, pid in pids.items():
        try:
            sizes[name] = int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024
        except (OSError, IndexError):
            sizes[name] = 0.0
    return sizes


class Sentinel(threading.Thread):
    """A well-behaved client: its greedy requests, one after another, must answer as they did undisturbed."""

    def __init__(self, address: str, prompts: list[list[int]]) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.prompts = prompts
        self.stop = threading.Event()
        self.max_gap_s = self.max_first_s = 0.0
        self.expected = {i: self._ask(f"ref-{i}", prompt) for i, prompt in enumerate(prompts)}
        self.num_requests = self.num_lost = self.num_hung = 0
        self.max_gap_s = self.max_first_s = 0.0  # measured while the fuzz runs

    def _ask(self, request_id: str, prompt: list[int]) -> list[int] | str:
        """The request's tokens, or why it did not end well: "hung" or the error's code."""
        ctx = zmq.Context()
        sock = make_socket(ctx, SocketSpec(zmq.DEALER, self.address, bind=False))
        try:
            sock.send(encode(Hello(PROTOCOL_VERSION, "sentinel")))
            sock.send(encode(Generate(request_id, token_ids=prompt, params=SENTINEL_PARAMS)))
            tokens: list[int] = []
            deadline = last = time.monotonic()
            deadline += REPLY_TIMEOUT_S
            while sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                reply = client_reply_decoder.decode(sock.recv())
                now = time.monotonic()
                if tokens:
                    self.max_gap_s = max(self.max_gap_s, now - last)
                else:
                    self.max_first_s = max(self.max_first_s, now - last)
                last = now
                if isinstance(reply, Error):
                    return reply.code
                if isinstance(reply, Tokens):
                    tokens += reply.token_ids
                    if reply.finished:
                        return tokens
            return "hung"
        finally:
            sock.close()
            ctx.term()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            n = i % len(self.prompts)
            got = self._ask(f"s-{i}", self.prompts[n])
            self.num_requests += 1
            if got == "hung":
                self.num_hung += 1
            elif got != self.expected[n]:
                self.num_lost += 1
            i += 1


class Fuzzer:
    def __init__(self, node: Node, key: ClusterKey, seed: int = 0) -> None:
        self.node = node
        self.key = key
        self.rng = random.Random(seed)
        self.report = FuzzReport()
        self.ctx = zmq.Context()

    # -- ports --------------------------------------------------------------------------------------

    def internal_ports(self) -> dict[str, tuple[str, list[str]]]:
        """name -> (address, tags it speaks): the controller, every inbox the controller lists, the KV servers."""
        controller = f"tcp://127.0.0.1:{self.node.controller_port}"
        ports = {"controller": (controller, INTERNAL_TAGS)}
        view = cluster_view(controller, "fuzz-probe", self.key, timeout_s=5.0)
        if isinstance(view, str):
            raise RuntimeError(f"cannot list the node's workers: {view}")
        for worker in view.workers:
            ports[worker.process_id] = (worker.address, INTERNAL_TAGS)
        for line in self.node.log_path.read_text().splitlines():
            if line.startswith("{") and '"kv source serving"' in line:
                event = json.loads(line)
                if event["address"].startswith("tcp://"):
                    ports[f"kv {event['process']}"] = (event["address"], KV_TAGS)
            if line.startswith("{") and '"gateway serving"' in line:
                ports["gateway inbox"] = (json.loads(line)["inbox"], INTERNAL_TAGS)
        return ports

    # -- one port each ----------------------------------------------------------------------------------

    def client(self, n: int) -> None:
        """Hostile frames on connections with and without `Hello`, and short requests cancelled at random."""
        expected: dict[str, zmq.Socket] = {}
        sockets = []
        for i in range(n):
            if i % 50 == 0:
                sock = make_socket(self.ctx, SocketSpec(zmq.DEALER, self.node.address, bind=False))
                if self.rng.random() < 0.7:
                    sock.send(encode(Hello(PROTOCOL_VERSION, "fuzz")))
                sockets.append(sock)
            sock = sockets[-1]
            roll = self.rng.random()
            if roll < 0.25:
                rid = f"f{i}"
                sock.send(encode(Generate(rid, token_ids=[self.rng.randrange(1, 500) for _ in range(20)],
                                          params=SamplingParams(temperature=0.0, max_tokens=self.rng.randrange(1, 4)))))
                if self.rng.random() < 0.6:  # many cancels land on a request's last step, at either worker
                    time.sleep(self.rng.random() * 0.03)
                    sock.send(encode(Cancel(rid)))
                expected[rid] = sock
            elif roll < 0.3:
                sock.send_multipart([hostile_frame(self.rng, CLIENT_TAGS) for _ in range(self.rng.randrange(2, 4))])
            else:
                sock.send(hostile_frame(self.rng, CLIENT_TAGS))
            self.report.inputs += 1
        self.report.hangs += self._unanswered(expected)
        for sock in sockets:
            sock.close(linger=0)

    def valid_hostile(self, n: int, prompts: list[list[int]]) -> None:
        """Valid requests at their limits and floods (pdrt/testing/hostile_requests.py): each must end."""
        client = HostileClient(self.ctx, self.node.address, prompts, self.rng.randrange(1 << 30))
        try:
            self.report.hangs += client.run(n)
        finally:
            client.close()
        self.report.valid_hostile += client.num_inputs
        self.report.inputs += client.num_inputs
        self.report.refusals = dict(client.refusals)
        self.report.per_port["client (valid, hostile)"] = client.num_inputs

    def _unanswered(self, expected: dict[str, zmq.Socket]) -> int:
        """How many of the well-formed requests never ended (each gets finished tokens or an error)."""
        ended: set[str] = set()
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        sockets = set(expected.values())
        poller = zmq.Poller()
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
        while len(ended) < len(expected) and time.monotonic() < deadline:
            for sock, _ in poller.poll(100):
                for frame in sock.recv_multipart():
                    try:
                        reply = client_reply_decoder.decode(frame)
                    except msgspec.DecodeError:
                        continue
                    rid = getattr(reply, "request_id", None)
                    if rid in expected and (isinstance(reply, Error) or (isinstance(reply, Tokens) and reply.finished)):
                        ended.add(rid)
        return len(set(expected) - ended)

    def http(self, base: str, n: int) -> None:
        for _ in range(n):
            method, path = self.rng.choice(HTTP_ROUTES)
            if self.rng.random() < 0.3:
                body = self.rng.randbytes(self.rng.randrange(64))
            elif self.rng.random() < 0.1:
                body = b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
            else:
                fields = self.rng.sample(HTTP_FIELDS, self.rng.randrange(len(HTTP_FIELDS)))
                doc = {f: self._http_value(f) for f in fields}
                body = json.dumps(doc, default=repr).encode()
            request = urllib.request.Request(base + path, data=body if method != "GET" else None, method=method,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=REPLY_TIMEOUT_S) as response:
                    response.read()
            except urllib.error.HTTPError as exc:
                exc.read()
                self.report.server_errors += exc.code == 500
            except (TimeoutError, urllib.error.URLError, ConnectionError):
                self.report.hangs += 1
            self.report.inputs += 1

    def _http_value(self, name: str) -> object:
        if name == "max_tokens":  # never a long valid one: a request that runs for minutes is no finding
            return self.rng.choice([-1, 0, 1, 3, 2**31, 2**70, "8", 1.5, None, [], {}])
        if self.rng.random() < 0.5:
            return random_value(self.rng)
        return {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi",
                "temperature": self.rng.choice([0, 5e-324, 1e-30, 0.7]), "stream": self.rng.random() < 0.5,
                "seed": 2**70, "stop": ["\n"], "n": 1}.get(name, random_value(self.rng))

    def udp(self, port: int, n: int, warmup_key: bytes) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for _ in range(n):
                if self.rng.random() < 0.5:
                    data = self.rng.randbytes(self.rng.randrange(1, 600))
                else:
                    data = bytearray(sign(warmup_key if self.rng.random() < 0.5 else b"wrong", "s", "m"))
                    data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
                    data = bytes(data)
                sock.sendto(data, ("127.0.0.1", port))
                self.report.inputs += 1

    def internal(self, name: str, address: str, tags: list[str], n: int) -> None:
        """Frames from strangers (no key, another key: every handshake that succeeds is counted) and from insiders."""
        strangers = [None, ClusterKey.generate()]
        for stranger in strangers:
            sock, monitor = self._monitored(address, stranger, b"gateway")
            for _ in range(n // 4):
                try:
                    sock.send(hostile_frame(self.rng, tags), flags=zmq.NOBLOCK)
                except zmq.Again:  # no connection: the handshake failed, as it must
                    pass
                self.report.inputs += 1
            self.report.unauthenticated_accepted += self._handshakes(monitor)
            sock.close(linger=0)
            monitor.close(linger=0)
        for i in range(n - 2 * (n // 4)):
            if i % 25 == 0:
                # Names of every role, none taken: a ROUTER refuses a second peer of a name in use.
                identity = self.rng.choice([b"gateway-fz", b"decode-fz", b"prefill-fz", b"colocated-fz", b"x.y",
                                            b"fz" + self.rng.randbytes(6)])
                insider = make_socket(self.ctx, SocketSpec(zmq.DEALER, address, bind=False, identity=identity,
                                                           key=self.key))
                insider.setsockopt(zmq.SNDTIMEO, 2000)  # the first send waits for the handshake
            if tags is KV_TAGS and self.rng.random() < 0.5:
                ids = [self.rng.randrange(-5, 10**6)] * self.rng.choice([1, 1000, 100_000])
                frame = encode(KVPullRequest(i, self.rng.choice(["", "gateway-0", "x"]), ids))
            else:
                frame = hostile_frame(self.rng, tags)
            try:
                insider.send(frame)
            except zmq.Again:
                self.report.undelivered += 1
            while insider.poll(0):
                insider.recv_multipart()
            self.report.inputs += 1
            if i % 25 == 24:
                insider.close(linger=100)
        self.report.per_port[name] = n

    def _monitored(self, address: str, key: ClusterKey | None, identity: bytes) -> tuple[zmq.Socket, zmq.Socket]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, identity)
        if key is not None:
            sock.curve_secretkey, sock.curve_publickey = key.secret, key.public
            sock.curve_serverkey = self.key.public  # even knowing the cluster's public key
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(address)
        return sock, monitor

    def _handshakes(self, monitor: zmq.Socket) -> int:
        succeeded = 0
        deadline = time.monotonic() + HANDSHAKE_WAIT_S
        while monitor.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            event = recv_monitor_message(monitor)
            succeeded += event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        return succeeded

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def run_fuzz(node: Node, key: ClusterKey, warmup_key: str, http_base: str, udp_port: int, per_port: int,
             sentinel_prompts: list[list[int]], seed: int = 0) -> FuzzReport:
    """Fuzz every port of `node` with `per_port` inputs while a sentinel client checks its answers."""
    pids = node.child_pids()
    sentinel = Sentinel(node.address, sentinel_prompts)
    before = rss_mb(pids)
    fuzzer = Fuzzer(node, key, seed)
    sentinel.start()
    try:
        ports = fuzzer.internal_ports()
        fuzzer.client(per_port)
        fuzzer.valid_hostile(per_port, sentinel_prompts)
        fuzzer.http(http_base, per_port)
        fuzzer.udp(udp_port, per_port, warmup_key.encode())
        for name, (address, tags) in ports.items():
            fuzzer.internal(name, address, tags, per_port)
        fuzzer.report.per_port.update(client=per_port, http=per_port, udp=per_port)
    finally:
        sentinel.stop.set()
        sentinel.join(REPLY_TIMEOUT_S + 5)
        fuzzer.close()
    report = fuzzer.report
    time.sleep(1.0)  # what the last inputs started settles
    after = node.child_pids()
    report.crashes = sum(after.get(name) != pid for name, pid in pids.items()) + (node.process.poll() is not None)
    report.hangs += sentinel.num_hung
    report.lost = sentinel.num_lost
    report.sentinel_requests = sentinel.num_requests
    report.stall_max_ms, report.first_frame_max_ms = 1000 * sentinel.max_gap_s, 1000 * sentinel.max_first_s
    grown = rss_mb(after)
    report.rss_growth_by_process = {name: round(grown.get(name, 0.0) - size, 1) for name, size in before.items()}
    report.rss_growth_mb = sum(report.rss_growth_by_process.values())
    return report
