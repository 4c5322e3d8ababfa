"""What the runtime costs on top of the engine, side by side in one run.

  (a) decode steps/s of a decode worker inside a running `pdrt up` node (its
      tokens counted as the client receives them) against the engine alone
      in this process, at the same batch, thread count and prompts;
  (b) the client round trip of the control path: `GetStatus` to the gateway
      and back, on an idle node;
  (c) what the cluster key costs the internal plane: a round trip between a
      DEALER and a ROUTER made by pdrt's socket helper, as every internal
      message travels, plain and under CURVE, alternating.

Each figure is the median of --repeats windows (round trips: of 2000). The
engine runs first, alone, and then the node, so neither competes with the
other for the cores. The last line:
`overhead runtime_vs_engine=X rtt_us=Y internal_rtt_us=P curve_rtt_us=Q`.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import zmq

from pdrt.actors.cluster_key import ClusterKey
from pdrt.actors.sockets import SocketSpec, bound_address, make_socket
from pdrt.engine import EngineConfig, LLMEngine, SamplingParams
from pdrt.models.fetch import default_model_dir, is_fetched
from pdrt.node_config import NodeConfig
from pdrt.testing.node import Node
from pdrt.testing.prompts import random_prompts
from pdrt.testing.tiny_model import build_tiny_model
from pdrt.wire import (
    PROTOCOL_VERSION,
    Cancel,
    Generate,
    GetStatus,
    Heartbeat,
    Hello,
    Tokens,
    client_reply_decoder,
    encode,
)

PROMPT_LEN = 64
WARMUP_STEPS = 8
MAX_TOKENS = 1000  # more than any measurement lasts
KV_CACHE_BYTES = 1 << 30


def engine_steps_per_s(model: str, prompts: list[list[int]], threads: int, window_s: float, repeats: int) -> float:
    engine = LLMEngine(EngineConfig(model=model, num_threads=threads, kv_cache_memory_bytes=KV_CACHE_BYTES))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(WARMUP_STEPS):  # prefill, then a few decode steps
        engine.step()
    rates = []
    for _ in range(repeats):
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < window_s:
            engine.step()
            steps += 1
        rates.append(steps / (time.perf_counter() - start))
    return statistics.median(rates)


class Client:
    def __init__(self, address: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.ask(Hello(PROTOCOL_VERSION))

    def ask(self, message) -> object:
        self.socket.send(encode(message))
        return self.recv()

    def recv(self, timeout_s: float = 60.0) -> object:
        if not self.socket.poll(int(timeout_s * 1000)):
            raise TimeoutError("the node stopped answering")
        return client_reply_decoder.decode(self.socket.recv())


def runtime_steps_per_s(client: Client, prompts: list[list[int]], window_s: float, repeats: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        client.socket.send(encode(Generate(f"d{i}", token_ids=prompt, params=params)))
    counts = {f"d{i}": 0 for i in range(len(prompts))}

    def take(timeout_s: float) -> None:
        reply = client.recv(timeout_s)
        if not isinstance(reply, Tokens):
            raise RuntimeError(f"unexpected reply {reply}")
        counts[reply.request_id] += len(reply.token_ids)

    while min(counts.values()) < WARMUP_STEPS:
        take(60)
    rates = []
    for _ in range(repeats):
        before, start = sum(counts.values()), time.perf_counter()
        while time.perf_counter() - start < window_s:
            take(10)
        rates.append((sum(counts.values()) - before) / len(prompts) / (time.perf_counter() - start))
    for i in range(len(prompts)):
        client.socket.send(encode(Cancel(f"d{i}")))
    return statistics.median(rates)


def rtt_us(client: Client, n: int = 2000) -> float:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        client.ask(GetStatus())
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def internal_rtt_us(key: ClusterKey | None, n: int = 2000) -> float:
    """Median microseconds of a small message from a DEALER to a ROUTER and back, as pdrt's sockets carry it."""
    ctx = zmq.Context()
    router = make_socket(ctx, SocketSpec(zmq.ROUTER, "tcp://127.0.0.1:*", bind=True, key=key))
    dealer = make_socket(ctx, SocketSpec(zmq.DEALER, bound_address(router), bind=False, identity=b"decode-0",
                                         key=key))
    frame = encode(Heartbeat("decode-0", "0123abcd"))
    samples = []
    try:
        for i in range(n + 100):  # the first ones include the handshake
            start = time.perf_counter()
            dealer.send(frame)
            identity, payload = router.recv_multipart()
            router.send_multipart([identity, payload])
            dealer.recv()
            if i >= 100:
                samples.append((time.perf_counter() - start) * 1e6)
    finally:
        ctx.destroy(linger=0)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: SmolLM2 if fetched, else a tiny model)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--window", type=float, default=3.0, help="seconds per measurement window")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="pdrt-bench-overhead-"))
    model = args.model or (str(default_model_dir()) if is_fetched() else str(build_tiny_model(workdir / "tiny")))
    threads = NodeConfig(model=model).threads_for("decode")
    torch.set_num_threads(threads)
    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    prompts = random_prompts(args.batch, PROMPT_LEN, vocab, seed=0)
    print(f"model {model}, batch {args.batch}, {threads} thread(s) per worker, {args.repeats} x {args.window} s")

    engine_rate = engine_steps_per_s(model, prompts, threads, args.window, args.repeats)
    print(f"engine alone        {engine_rate:8.1f} decode steps/s")
    with Node(workdir, model, engine={"kv_cache_bytes": KV_CACHE_BYTES}, ready_timeout_s=300) as node:
        client = Client(node.address)
        rtt = rtt_us(client)
        print(f"control round trip  {rtt:8.1f} us (GetStatus, median of 2000)")
        runtime_rate = runtime_steps_per_s(client, prompts, args.window, args.repeats)
        print(f"decode worker       {runtime_rate:8.1f} decode steps/s (tokens per request per second at the client)")
    plain, curve = [], []
    for _ in range(args.repeats):
        plain.append(internal_rtt_us(None))
        curve.append(internal_rtt_us(ClusterKey.generate()))
    plain_us, curve_us = statistics.median(plain), statistics.median(curve)
    print(f"internal round trip {plain_us:8.1f} us plain, {curve_us:.1f} us under the cluster key (CURVE), "
          f"x{curve_us / plain_us:.2f}")
    print(f"overhead runtime_vs_engine={runtime_rate / engine_rate:.3f} rtt_us={rtt:.0f} "
          f"internal_rtt_us={plain_us:.0f} curve_rtt_us={curve_us:.0f}")


if __name__ == "__main__":
    main()
