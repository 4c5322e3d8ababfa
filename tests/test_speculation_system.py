"""Speculative decoding through a real node (one prefill and two decode workers) of a deep twin of the tiny model
(its outputs, at the cost of 32 layers) whose draft model is the tiny model, so that every greedy proposal is
kept and proposing costs little against a step: streams get several tokens a frame, the same tokens
as with speculation off (greedy and seeded), through the native protocol and the OpenAI API with the right usage,
and a decode worker killed mid-stream changes nothing."""

import msgspec
import openai
import pytest

from pdrt.client.spawned_server import free_port
from pdrt.testing.chaos import batch, run_streams, wait_restarted
from pdrt.testing.node import Node
from pdrt.testing.tiny_model import build_deep_twin
from tests.system_client import scrape, used_blocks, wait_for

MAX_TOKENS = 60


@pytest.fixture(scope="module")
def node(model_dirs, tmp_path_factory):
    http_port, metrics_port = free_port(), free_port()
    workdir = tmp_path_factory.mktemp("spec")
    twin = build_deep_twin(model_dirs["llama"], workdir / "twin", num_layers=32)
    with Node(workdir, str(twin), engine={"speculate": str(model_dirs["llama"])},
              extra={"decode": {"count": 2}, "gateway": {"http_port": http_port},
                     "controller": {"metrics_port": metrics_port}}) as running:
        running.http = f"http://127.0.0.1:{http_port}"
        running.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        yield running


@pytest.fixture(scope="module")
def streams(prompts):
    return batch([p[:300] for p in prompts[3:7]], MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(node, streams):
    """The same streams with speculation off."""
    off = {name: (prompt, msgspec.structs.replace(params, speculate=False))
           for name, (prompt, params) in streams.items()}
    return run_streams(node.address, off).results


def several_at_once(token_times: dict[str, list[float]]) -> int:
    """Tokens that arrived with the one before them, in one frame."""
    return sum(a == b for times in token_times.values() for a, b in zip(times, times[1:], strict=False))


def accepted(node: Node) -> float:
    return sum(s.value for f in scrape(node)[1] for s in f.samples
               if s.name == "pdrt_worker_spec_accepted_tokens_total")


def test_streams_get_several_tokens_a_frame_and_the_same_tokens_as_without_speculation(node, streams, plain):
    run = run_streams(node.address, streams)
    assert not run.lost() and not run.hung() and run.results == plain
    greedy = {name: times for name, times in run.token_times.items() if streams[name][1].is_greedy}
    assert several_at_once(greedy) > len(greedy) * MAX_TOKENS // 2  # the sampled keep fewer: the gate says when
    wait_for(lambda: accepted(node) > 0, timeout_s=10)


def test_a_decode_worker_killed_mid_stream_changes_no_output(node, streams, plain):
    run = run_streams(node.address, streams, kill=(node, "decode-0"), kill_after=10)
    assert not run.lost() and not run.hung() and run.results == plain
    wait_restarted(node, "decode-0", run.killed_pid)
    wait_for(lambda: set(used_blocks(node).values()) == {0}, timeout_s=30, interval_s=0.2)


def test_the_openai_api_streams_them_with_the_right_usage(node):
    api = openai.OpenAI(base_url=node.http + "/v1", api_key="none", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "def parse(text): return text.split() " * 20}]
    answers = {}
    for speculate in (True, False):
        chunks = list(api.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                                  temperature=0, stream=True, stream_options={"include_usage": True},
                                                  extra_body={"speculate": speculate, "ignore_eos": True}))
        answers[speculate] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert answers[True] == answers[False]
