"""What careless or hostile clients send, against a real disaggregated node: each gets a typed answer, the
requests of everyone else go on unchanged, and no process of the node dies."""

import json
import random
import time
import urllib.error
import urllib.request

import msgspec
import pytest
import torch

from pdrt.engine.sampling_params import SamplingParams
from pdrt.testing.node import Node, free_port
from pdrt.wire import Cancel, ChatMessage, Error, Generate, Tokens
from tests.system_client import RawClient

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def node(model_dirs, tmp_path_factory):
    http_port = free_port()
    with Node(tmp_path_factory.mktemp("hostile"), str(model_dirs["llama"]),
              extra={"gateway": {"http_port": http_port}}) as running:
        running.http = f"http://127.0.0.1:{http_port}"
        running.pids = running.child_pids()
        yield running
        assert running.child_pids() == running.pids, "a process of the node restarted"


def collect(client: RawClient, request_ids: set[str], timeout_s: float = 60.0) -> dict[str, Tokens | Error]:
    """Each request's tokens merged into its final frame (or its error), until every one has ended."""
    ended: dict[str, Tokens | Error] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid in request_ids}
    logprobs: dict[str, list[float]] = {rid: [] for rid in request_ids}
    deadline = time.monotonic() + timeout_s
    while set(ended) != request_ids:
        reply = client.recv(max(0.1, deadline - time.monotonic()))
        if isinstance(reply, Error) or reply.request_id in ended:
            ended.setdefault(reply.request_id, reply)
            continue
        tokens[reply.request_id] += reply.token_ids
        logprobs[reply.request_id] += reply.logprobs or []
        if reply.finished:
            ended[reply.request_id] = msgspec.structs.replace(reply, token_ids=tokens[reply.request_id],
                                                              logprobs=logprobs[reply.request_id])
    return ended


def gateway_rss_mb(node) -> float:
    status = open(f"/proc/{node.child_pids()['gateway']}/status").read()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def test_cancels_that_land_at_any_point_of_a_request_never_take_a_worker_down(node, client, prompts, references):
    rng = random.Random(0)
    for i in range(40):  # short requests: many cancels land on a last step, on the prefill or the decode worker
        client.send(Generate(f"c{i}", token_ids=prompts[1 + i % 6], params=SamplingParams(
            temperature=0.0, max_tokens=rng.randint(1, 3))))
        time.sleep(rng.random() * 0.03)
        client.send(Cancel(f"c{i}"))
    time.sleep(1.0)
    while client.socket.poll(100):
        client.socket.recv()
    assert node.child_pids() == node.pids
    assert client.generate_many([prompts[7]], GREEDY)["r0"] == references["llama"].greedy(prompts[7])


def test_logprobs_through_prefill_and_decode_workers_match_transformers_and_spare_the_other_requests(
        client, prompts, references):
    prompt, other = prompts[8], prompts[9]
    client.send(Generate("lp", token_ids=prompt, params=SamplingParams(temperature=0.0, max_tokens=8,
                                                                       logprobs=True)))
    client.send(Generate("other", token_ids=other, params=GREEDY))
    ended = collect(client, {"lp", "other"})
    reference = references["llama"]
    assert ended["other"].token_ids == reference.greedy(other)
    got = ended["lp"]
    assert got.token_ids == reference.greedy(prompt, 8) and len(got.logprobs) == 8
    with torch.no_grad():
        logits = reference.model(torch.tensor([prompt + got.token_ids])).logits[0, len(prompt) - 1:-1]
    expected = logits.float().log_softmax(-1).gather(-1, torch.tensor(got.token_ids).unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(torch.tensor(got.logprobs), expected, atol=1e-3)


def test_a_temperature_too_small_to_divide_by_samples_the_greedy_answer(client, prompts, references):
    tiny = SamplingParams(temperature=5e-324, max_tokens=12, seed=1)
    assert client.generate_many([prompts[6]], tiny)["r0"] == references["llama"].greedy(prompts[6])


def test_an_empty_conversation_and_a_deeply_nested_frame_get_typed_errors(client):
    empty = client.ask(Generate("empty", messages=[]))
    assert isinstance(empty, Error) and (empty.code, empty.request_id) == ("invalid_request", "empty")
    deep = client.ask(b"\x93\xa8generate\xa4deep" + b"\x91" * 100_000 + b"\xc0")
    assert isinstance(deep, Error) and deep.code == "invalid_frame"


def test_a_conversation_of_more_messages_than_the_context_holds_is_refused_before_it_is_rendered(client):
    many = client.ask(Generate("many", messages=[ChatMessage("u", "")] * 200_000))  # each is at least a token
    assert isinstance(many, Error) and (many.code, many.request_id) == ("prompt_too_long", "many")


def test_a_prompt_the_context_could_never_hold_is_refused_before_it_is_tokenized(node, client):
    before = gateway_rss_mb(node)
    huge = client.ask(Generate("huge", prompt="x" * ((8 << 20) - 1000)))
    assert isinstance(huge, Error) and (huge.code, huge.request_id) == ("prompt_too_long", "huge")
    assert gateway_rss_mb(node) - before < 100


def test_a_large_prompt_is_tokenized_off_the_event_loop_and_answers_as_its_tokens_do(client, tokenizer, references):
    text = " " * 20_000 + "def parse(items):"  # above the size tokenized in place; few tokens
    ids = tokenizer(text)["input_ids"]
    assert len(ids) < 2000
    client.send(Generate("large", prompt=text, params=GREEDY))
    client.send(Generate("small", prompt="def parse(items):", params=GREEDY))
    ended = collect(client, {"large", "small"})
    assert ended["large"].token_ids == references["llama"].greedy(ids)
    assert ended["small"].token_ids == references["llama"].greedy(tokenizer("def parse(items):")["input_ids"])
    client.send(Generate("gone", prompt=text, params=GREEDY))
    client.send(Cancel("gone"))
    gone = collect(client, {"gone"})["gone"]
    assert isinstance(gone, Tokens) and gone.finish_reason == "cancelled"


def http(node, path: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(node.http + path, method="POST", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_http_bodies_nested_too_deep_or_with_huge_integers_are_bad_requests(node):
    assert http(node, "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")[0] == 400
    huge = str(2**70).encode()
    assert http(node, "/v1/completions", b'{"prompt": "hi", "max_tokens": ' + huge + b"}")[0] == 400
    assert http(node, "/v1/completions", b'{"prompt": [' + huge + b"], \"max_tokens\": 2}")[0] == 400
    assert http(node, "/v1/completions", b'{"prompt": "hi", "seed": ' + huge + b"}")[0] == 400
    status, body = http(node, "/v1/completions", b'{"prompt": "hi", "max_tokens": 4, "temperature": 5e-324}')
    assert status == 200
    greedy = http(node, "/v1/completions", b'{"prompt": "hi", "max_tokens": 4, "temperature": 0}')[1]
    assert body["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert node.child_pids() == node.pids
