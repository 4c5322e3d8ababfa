"""Type-ahead and warmup through `pdrt up`: typed prompts equal one-shot ones, expiry frees KV, floods do nothing."""

import inspect
import os
import random
import socket
import time

import pytest

from pdrt.engine.sampling_params import SamplingParams
from pdrt.testing.node import Node, free_port
from pdrt.warmup.datagram import sign
from pdrt.wire import (
    ChatMessage,
    DraftAbandon,
    DraftAppend,
    DraftOpen,
    DraftReplace,
    DraftSubmit,
    Error,
    Generate,
    Tokens,
    Warmup,
)
from tests.system_client import RawClient, used_blocks, wait_for
from tests.system_client import node_status as status

KEY = "test-warmup-key"
GREEDY = SamplingParams(temperature=0, max_tokens=10)
TEXT = inspect.getsource(random)


@pytest.fixture(scope="module")
def node(model_dirs, tmp_path_factory):
    warmup_port = free_port()
    with Node(tmp_path_factory.mktemp("typeahead"), str(model_dirs["llama"]),
              extra={"warmup": {"key": KEY, "port": warmup_port},
                     "experimental": {"min_draft_chunk": 16, "draft_ttl_s": 3.0, "warmup_ttl_s": 2.0}}) as running:
        running.warmup_port = warmup_port
        yield running


def collect(client: RawClient, request_id: str) -> list[int]:
    tokens: list[int] = []
    while True:
        reply = client.recv()
        assert not isinstance(reply, Error), reply
        assert isinstance(reply, Tokens) and reply.request_id == request_id
        tokens += reply.token_ids
        if reply.finished:
            return tokens


def type_draft(client: RawClient, draft_id: str, text: str, rng: random.Random) -> None:
    """Type `text` in random bursts with pauses, making typos and fixing them."""
    typed = ""
    while typed != text:
        if rng.random() < 0.2 and typed:  # a typo, noticed and erased
            wrong = "".join(rng.choice("xyzq#") for _ in range(rng.randint(1, 8)))
            client.send(DraftAppend(draft_id, wrong))
            client.send(DraftReplace(draft_id, len(typed), ""))
        n = rng.randint(1, 60)
        piece = text[len(typed): len(typed) + n]
        if rng.random() < 0.1 and len(typed) > 30:  # rewrite the last words
            keep = len(typed) - rng.randint(1, 30)
            client.send(DraftReplace(draft_id, keep, typed[keep:] + piece))
        else:
            client.send(DraftAppend(draft_id, piece))
        typed += piece
        if rng.random() < 0.3:
            time.sleep(rng.uniform(0.0, 0.05))


@pytest.mark.parametrize("chat", [True, False])
def test_a_typed_then_submitted_prompt_gives_the_output_of_the_same_prompt_sent_at_once(node, client, chat):
    rng = random.Random(1 if chat else 2)
    history = [ChatMessage("user", "hello"), ChatMessage("assistant", "hi, what can I do?")] if chat else None
    for i, length in enumerate((150, 900, 2500)):
        text = TEXT[i * 3000: i * 3000 + length]
        client.send(DraftOpen(f"d{i}", messages=history))
        type_draft(client, f"d{i}", text, rng)
        client.send(DraftSubmit(f"d{i}", f"typed{i}", params=GREEDY))
        typed = collect(client, f"typed{i}")
        if chat:
            one_go = Generate(f"once{i}", messages=[*history, ChatMessage("user", text)], params=GREEDY)
        else:
            one_go = Generate(f"once{i}", prompt=text, params=GREEDY)
        client.send(one_go)
        assert typed == collect(client, f"once{i}"), f"prompt of {length} characters"
    loads = {w.process_id: w.load for w in status(node).workers}
    assert loads["prefill-0"].num_draft_tokens_ahead > 0  # the prompts were prefilled before their submit
    counters = status(node).counters
    assert counters["drafts_submitted"] >= 3 and counters["draft_updates"] > 3


def test_an_abandoned_or_expired_draft_frees_all_its_blocks(node, client):
    wait_for(lambda: set(used_blocks(node).values()) == {0}, 10)
    for draft_id in ("gone", "idle"):
        client.send(DraftOpen(draft_id))
        client.send(DraftAppend(draft_id, TEXT[:3000]))
    wait_for(lambda: used_blocks(node)["prefill-0"] > 0, 10)
    client.send(DraftAbandon("gone"))
    expired = client.recv(timeout_s=10)  # the idle draft times out after draft_ttl_s
    assert isinstance(expired, Error) and expired.code == "timeout" and expired.request_id == "idle"
    wait_for(lambda: set(used_blocks(node).values()) == {0}, 10)


def test_a_warmup_prefills_the_sessions_conversation_and_its_expiry_frees_the_blocks(node, client):
    wait_for(lambda: set(used_blocks(node).values()) == {0}, 10)
    messages = [ChatMessage("system", TEXT[:2000]), ChatMessage("user", "go on")]
    client.send(Generate("first", messages=messages, params=GREEDY, session_id="s1"))
    collect(client, "first")
    before = status(node).counters
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.sendto(sign(KEY.encode(), "s1", "llama"), ("127.0.0.1", node.warmup_port))
    wait_for(lambda: used_blocks(node)["prefill-0"] > 0, 10)  # the conversation is being prefilled
    counters = status(node).counters
    assert counters["warmups"] == before.get("warmups", 0) + 1 and counters["warmup_reservations"] == 1
    client.send(Generate("second", messages=[*messages, ChatMessage("assistant", "ok"),
                                             ChatMessage("user", "more")], params=GREEDY, session_id="s1"))
    collect(client, "second")
    assert status(node).counters["warmup_hits"] >= 1
    wait_for(lambda: status(node).counters["warmup_reservations"] == 0, 10)
    wait_for(lambda: set(used_blocks(node).values()) == {0}, 10)
    client.send(Warmup("never-seen"))  # the native twin of the datagram; unknown sessions reserve nothing
    wait_for(lambda: status(node).counters.get("warmups_unknown_session", 0) >= 1, 5)


def test_a_flood_of_bad_datagrams_reserves_nothing_keeps_memory_bounded_and_requests_served(node, client):
    gateway_pid = node.child_pids()["gateway"]

    def rss_kb() -> int:
        for line in open(f"/proc/{gateway_pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    before, rss_before = status(node).counters, rss_kb()
    valid = sign(KEY.encode(), "s1", "llama")
    kinds = [lambda i: os.urandom(i % 300),  # malformed
             lambda i: sign(b"forged key", f"s{i}", "llama"),  # unauthenticated
             lambda i: sign(KEY.encode(), f"s{i}", "llama", timestamp=time.time() - 3600),  # stale
             lambda i: valid]  # replayed (after its first, rate-limited or replayed)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        for i in range(100_000):
            udp.sendto(kinds[i % 4](i), ("127.0.0.1", node.warmup_port))
            if i == 50_000:
                client.send(Generate("during", prompt="def f(x):", params=GREEDY))
    assert len(collect(client, "during")) == GREEDY.max_tokens
    time.sleep(1.0)
    after = status(node).counters
    assert after.get("warmups", 0) <= before.get("warmups", 0) + 1  # at most the one authentic datagram
    dropped = sum(v - before.get(k, 0) for k, v in after.items() if k.startswith("warmup_dropped_"))
    assert dropped > 10_000  # the kernel may drop some of a flood; every one that arrived was dropped here
    assert rss_kb() - rss_before < 50_000
