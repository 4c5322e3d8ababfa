"""The whole system through `pdrt up` in a subprocess: real processes, sockets and shared memory, a tiny model."""

import json
import os
import random
import time
from pathlib import Path

import msgspec
import pytest

from pdrt.engine.sampling_params import SamplingParams
from pdrt.testing.node import Node
from pdrt.wire import (
    MAX_CLIENT_FRAME_BYTES,
    PROTOCOL_VERSION,
    Cancel,
    Error,
    Generate,
    Hello,
    Tokens,
)
from tests.system_client import RawClient, allowed_cpus, niceness, used_blocks, wait_for

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def node(model_dirs, tmp_path_factory):
    with Node(tmp_path_factory.mktemp("node"), str(model_dirs["llama"]), extra={"experimental": {"own_cores": True}}) \
            as running:
        yield running


def mixed_prompts(prompts: list[list[int]], n: int) -> list[list[int]]:
    """`n` distinct prompts of the fixture's mixed lengths (1 to 1100 tokens)."""
    return [prompts[i % len(prompts)][i // len(prompts):] or [7 + i] for i in range(n)]


def test_32_concurrent_requests_of_mixed_lengths_equal_transformers_generate(node, client, prompts, references):
    batch = mixed_prompts(prompts, 32)
    results = client.generate_many(batch, GREEDY)
    reference = references["llama"]
    for i, prompt in enumerate(batch):
        assert results[f"r{i}"] == reference.greedy(prompt), f"request {i} ({len(prompt)} prompt tokens)"


def test_colocated_and_tcp_transfer_give_the_same_greedy_outputs_as_disaggregated(node, client, prompts, model_dirs,
                                                                                  tmp_path_factory):
    batch = mixed_prompts(prompts, 12)
    disaggregated = client.generate_many(batch, GREEDY, stream=False)
    for settings in ({"mode": "colocated"}, {"transfer": "tcp"}):
        with Node(tmp_path_factory.mktemp("other"), str(model_dirs["llama"]), **settings) as other:
            other_client = RawClient(other.address)
            try:
                assert other_client.generate_many(batch, GREEDY, stream=False) == disaggregated, settings
            finally:
                other_client.close()


def test_cancel_mid_stream_ends_the_stream_and_frees_kv_on_both_workers(node, client, prompts):
    client.send(Generate("long", token_ids=prompts[-1], params=SamplingParams(temperature=0, max_tokens=3000,
                                                                               ignore_eos=True)))
    received = 0
    while received < 3:
        reply = client.recv()
        assert isinstance(reply, Tokens) and not reply.finished
        received += len(reply.token_ids)
    wait_for(lambda: used_blocks(node)["decode-0"] > 0, timeout_s=5)  # loads arrive with heartbeats
    client.send(Cancel("long"))
    while not (isinstance(reply, Tokens) and reply.finished):
        reply = client.recv()
    assert reply.finish_reason == "cancelled"
    wait_for(lambda: set(used_blocks(node).values()) == {0}, timeout_s=5)


def test_malformed_frames_get_error_replies_and_the_gateway_keeps_serving(node, client, prompts, references):
    rng = random.Random(0)
    bad_frames = {
        "random bytes": bytes(rng.randrange(256) for _ in range(64)),
        "wrong types": msgspec.msgpack.encode(["generate", "x", 5, "not a list"]),
        "unknown tag": msgspec.msgpack.encode(["launch_missiles", "x"]),
        "bad sampling params": msgspec.msgpack.encode(["generate", "x", None, None, [1, 2], {"top_p": 0.0}]),
        "oversize": b"\x00" * (MAX_CLIENT_FRAME_BYTES + 1),
    }
    for what, frame in bad_frames.items():
        reply = client.ask(frame)
        assert isinstance(reply, Error), what
        assert reply.code in ("invalid_frame", "invalid_sampling_params"), (what, reply)
    assert client.ask(Hello(PROTOCOL_VERSION + 1)).code == "unsupported_version"
    stranger = RawClient(node.address, handshake=False)
    try:
        assert stranger.ask(Generate("y", token_ids=[1, 2])).code == "handshake_required"
        stranger.socket.send_multipart([b"two", b"frames"])
        assert stranger.recv().code == "invalid_frame"
    finally:
        stranger.close()
    assert client.ask(Generate("z", prompt="x", token_ids=[1])).code == "invalid_request"
    assert client.ask(Generate("z", token_ids=[1] * 5000)).code == "prompt_too_long"
    assert client.ask(Cancel("never-sent")).code == "unknown_request"
    assert client.generate_many([prompts[3]], GREEDY)["r0"] == references["llama"].greedy(prompts[3])


def test_one_request_id_follows_a_request_through_the_logs_of_every_process(node, client, prompts):
    assert client.generate_many([prompts[6]], GREEDY)["r0"]
    time.sleep(0.5)  # let the processes' log lines reach the supervisor's stderr
    lines = [json.loads(line) for line in node.log_path.read_text().splitlines() if line.startswith("{")]
    routed = [ln for ln in lines if ln.get("event") == "request routed" and ln.get("client_request_id") == "r0"]
    request_id = routed[-1]["request_id"]
    processes = {ln["process"] for ln in lines if ln.get("request_id") == request_id}
    assert {"gateway", "prefill-0", "decode-0"} <= processes


def test_the_prefill_worker_and_every_thread_it_has_yield_the_cpu_to_the_other_processes(node, client, prompts):
    # The tiny model's prefill worker catches up (pdrt/priority.py): it yields while no prompt waits.
    assert client.generate_many([prompts[2]], GREEDY)["r0"]  # its engine and OpenMP threads have started
    pids = node.child_pids()
    assert niceness(pids["prefill-0"]) == {10}
    others = {name: niceness(pids[name]) for name in ("controller", "gateway", "decode-0")}
    assert all(values == {os.getpriority(os.PRIO_PROCESS, 0)} for values in others.values()), others


def test_the_decode_worker_runs_on_a_core_of_its_own_and_every_other_process_on_the_rest(node, client, prompts):
    assert client.generate_many([prompts[2]], GREEDY)["r0"]  # every worker's engine and OpenMP threads run
    allowed = sorted(os.sched_getaffinity(0))
    threads = max(1, (os.cpu_count() or 1) // 2)  # each worker's default: the cores split evenly between the two
    # the prefill worker's share first (start order), then the decode worker's, where both fit
    own, rest = (allowed[threads:2 * threads], allowed[:threads] + allowed[2 * threads:]) \
        if 2 * threads <= len(allowed) else (allowed, allowed)
    cores = {name: allowed_cpus(pid) for name, pid in node.child_pids().items()}
    assert cores == {"decode-0": {frozenset(own)}, "prefill-0": {frozenset(rest)}, "gateway": {frozenset(rest)},
                     "controller": {frozenset(rest)}}


def test_kill_9_of_the_only_decode_worker_moves_its_streams_to_the_restarted_one_with_the_same_output(
        node, client, prompts, references):
    params = SamplingParams(temperature=0, max_tokens=400)
    batch = [prompts[i + 4] for i in range(4)]
    for i, prompt in enumerate(batch):
        client.send(Generate(f"k{i}", token_ids=prompt, params=params))
    tokens: dict[str, list[int]] = {f"k{i}": [] for i in range(4)}
    while not all(tokens.values()):
        reply = client.recv()
        assert isinstance(reply, Tokens)
        tokens[reply.request_id] += reply.token_ids
    old_pid = node.child_pids()["decode-0"]
    os.kill(old_pid, 9)
    ended: dict[str, Tokens] = {}
    while len(ended) < 4:
        reply = client.recv(timeout_s=60)
        assert isinstance(reply, Tokens), reply
        tokens[reply.request_id] += reply.token_ids
        if reply.finished:
            ended[reply.request_id] = reply
    assert node.child_pids()["decode-0"] != old_pid
    for i, prompt in enumerate(batch):
        assert tokens[f"k{i}"] == references["llama"].greedy(prompt, 400), f"stream {i}"
    wait_for(lambda: set(used_blocks(node).values()) == {0}, timeout_s=10)
    assert client.generate_many([prompts[5]], GREEDY)["r0"] == references["llama"].greedy(prompts[5])


def test_sigterm_leaves_no_process_and_no_shared_memory_segment(node):
    pids = node.child_pids()
    assert set(pids) == {"controller", "gateway", "prefill-0", "decode-0"}
    segments = list(Path("/dev/shm").glob(f"pdrt-{node.run_id}-*"))
    assert segments, "the prefill worker's pool lives in shared memory"
    assert node.stop() == 0
    for pid in [*pids.values(), node.process.pid]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not any(p.exists() for p in segments)
