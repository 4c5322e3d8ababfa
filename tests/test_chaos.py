"""SIGKILL (and SIGTERM, a stop) of each kind of process under a load of concurrent streams, and two minutes of
random ones, on real nodes with the tiny model: every stream completes, with the output of an undisturbed run
(greedy and seeded sampling alike), no KV block is left held on any worker, and the node goes on serving.
scripts/bench_chaos.py runs the same on the default model."""

import json
import random
import signal
import time

import pytest

from pdrt.errors import UnavailableError
from pdrt.supervisor.child import RestartPolicy
from pdrt.testing.chaos import batch, freeze, run_streams, uptime_s, wait_restarted
from pdrt.testing.node import Node
from tests.system_client import used_blocks, wait_for

MAX_TOKENS = 120
KV_LEASE_S = 3.0
SOAK_S = 120.0
# Streams long enough that the dead gateway's copies are still running when the workers learn it is lost (the
# supervisor reports the exit, the controller tells every worker): otherwise they finish first and none is dropped.
OUTLIVING_TOKENS = 800
STABLE_S = RestartPolicy().stable_after_s


@pytest.fixture(scope="module")
def streams(prompts):
    return batch([p[:300] for p in prompts[3:11]], MAX_TOKENS)


@pytest.fixture(scope="module")
def node(model_dirs, tmp_path_factory):
    # A short KV lease, so that a handoff given up runs it out within a test.
    with Node(tmp_path_factory.mktemp("chaos"), str(model_dirs["llama"]),
              extra={"decode": {"count": 2}, "experimental": {"kv_lease_s": KV_LEASE_S}}) as running:
        yield running


@pytest.fixture(scope="module")
def undisturbed(node, streams):
    run = run_streams(node.address, streams)
    assert all(isinstance(tokens, list) and tokens for tokens in run.results.values()), run.results
    return run.results


def assert_survived(node: Node, run, undisturbed: dict, process: str, streams) -> None:
    assert not run.hung() and not run.lost(), run.results
    assert run.results == undisturbed
    wait_restarted(node, process, run.killed_pid)
    wait_for(lambda: used_blocks(node) and set(used_blocks(node).values()) == {0}, timeout_s=30, interval_s=0.2)
    assert run_streams(node.address, streams).results == undisturbed  # and it serves as before


@pytest.mark.parametrize(("process", "kill_after", "kill_delay_s"), [
    ("decode-0", 3, 0.0),  # its streams move to decode-1
    ("prefill-0", 0, 0.05),  # prompts in flight there go to the restarted one
    ("controller", 3, 0.0),  # nothing is lost while the new one learns the cluster
    ("gateway", 3, 0.0),  # the client resumes every stream on the restarted gateway
])
def test_a_killed_process_loses_no_stream_and_changes_no_output(node, streams, undisturbed, process, kill_after,
                                                                 kill_delay_s):
    run = run_streams(node.address, streams, kill=(node, process), kill_after=kill_after, kill_delay_s=kill_delay_s)
    assert_survived(node, run, undisturbed, process, streams)


def dropped_for_lost_gateway(node: Node, after: int) -> dict[str, int]:
    """Requests each worker dropped because their gateway was lost, from the node's log past byte `after`."""
    dropped: dict[str, int] = {}
    for line in node.log_path.read_bytes()[after:].decode().splitlines():
        if '"gateway lost: its requests dropped"' in line:
            event = json.loads(line)
            dropped[event["process"]] = dropped.get(event["process"], 0) + event["requests"]
    return dropped


def test_a_killed_gateway_loses_no_logprob_and_no_draft_and_its_workers_drop_its_requests(node, prompts, tokenizer):
    """Streams with logprobs, half of them typed as drafts (which the lost gateway took with it): each is resumed,
    equal to an undisturbed run, logprobs included; the workers drop the dead gateway's copies at once."""
    texts = [tokenizer.decode(p[:200]) for p in prompts[11:13]]
    streams = batch([prompts[3][:300], texts[0], prompts[5][:300], texts[1]], OUTLIVING_TOKENS, ignore_eos=True,
                    logprobs=True)
    undisturbed = run_streams(node.address, streams)
    logged = node.log_path.stat().st_size
    run = run_streams(node.address, streams, kill=(node, "gateway"), kill_after=3)
    assert not run.hung() and not run.lost(), run.results
    assert run.results == undisturbed.results
    # Log-probabilities of the same tokens, computed in other batches (a continuation's prompt is prefilled): equal
    # to float rounding.
    for name in streams:
        assert len(run.logprobs[name]) == len(run.results[name])
        assert run.logprobs[name] == pytest.approx(undisturbed.logprobs[name], abs=1e-4), name
    assert sum(dropped_for_lost_gateway(node, logged).values()) == len(streams)
    wait_restarted(node, "gateway", run.killed_pid)


def test_a_stream_that_may_not_be_resumed_ends_with_gateway_lost_and_frees_its_kv(node, prompts, monkeypatch):
    monkeypatch.setattr("pdrt.client.async_stream.MAX_RESUMES", 0)
    streams = batch([p[:100] for p in prompts[3:7]], 3000, ignore_eos=True)
    logged = node.log_path.stat().st_size
    run = run_streams(node.address, streams, kill=(node, "gateway"), kill_after=3)
    assert set(run.results.values()) == {"gateway_lost"}, run.results
    wait_restarted(node, "gateway", run.killed_pid)
    assert sum(dropped_for_lost_gateway(node, logged).values()) == len(streams)
    wait_for(lambda: used_blocks(node) and set(used_blocks(node).values()) == {0}, timeout_s=10, interval_s=0.2)


def test_a_decode_worker_frozen_mid_handoff_then_killed_loses_nothing_and_its_prefill_worker_serves_on(
        node, streams, undisturbed):
    """The gateway gives up the frozen worker's handoffs and aborts them at the prefill worker, which keeps their KV
    until the lease runs out (the frozen worker might have been copying it), then frees it and serves on."""
    prefill = node.child_pids()["prefill-0"]
    run = run_streams(node.address, streams, kill=(node, "decode-0"), kill_after=1, before=freeze(node, "decode-0"))
    assert not run.hung() and not run.lost(), run.results
    assert run.results == undisturbed
    time.sleep(KV_LEASE_S + 1.0)  # the leases of the handoffs given up run out
    assert node.child_pids()["prefill-0"] == prefill
    assert_survived(node, run, undisturbed, "decode-0", streams)


def test_a_worker_stopped_mid_stream_moves_its_streams(node, streams, undisturbed):
    """SIGTERM, as `systemctl restart` or an operator's role change sends: the worker leaves the registry and its
    streams go on elsewhere."""
    run = run_streams(node.address, streams, kill=(node, "decode-0"), sig=signal.SIGTERM)
    assert_survived(node, run, undisturbed, "decode-0", streams)


def test_a_client_notices_a_frozen_gateway_and_resumes_when_it_answers_again(node, streams, undisturbed):
    """A gateway that stops answering (SIGSTOP: a hung host, a lost network) is noticed by its unanswered pings."""
    run = run_streams(node.address, streams, kill=(node, "gateway"), sig=signal.SIGSTOP, freeze_s=5.0)
    assert run.noticed_at is not None and run.noticed_at - run.killed_at <= 3.0
    assert not run.hung() and not run.lost(), run.results
    assert run.results == undisturbed


def test_a_killed_colocated_worker_moves_its_streams_to_another(model_dirs, tmp_path, streams):
    with Node(tmp_path, str(model_dirs["llama"]), mode="colocated", extra={"colocated": {"count": 2}}) as node:
        undisturbed = run_streams(node.address, streams).results
        run = run_streams(node.address, streams, kill=(node, "colocated-0"))
        assert_survived(node, run, undisturbed, "colocated-0", streams)


def test_a_soak_of_random_kills_under_load_loses_nothing(node, streams, undisturbed):
    rng = random.Random(0)
    deadline = time.monotonic() + SOAK_S
    kills = 0
    while time.monotonic() < deadline:
        # A process killed before it serves counts as crashing at start-up, and five such crashes in a row make
        # pdrt up give up (pdrt/supervisor/child.py): each kill waits until its process is up for the stable period.
        pids = node.child_pids()
        eligible = [p for p in ("decode-0", "decode-1", "prefill-0", "controller", "gateway")
                    if uptime_s(pids[p]) >= STABLE_S + 1.0]
        if not eligible:
            time.sleep(1.0)
            continue
        process = rng.choice(eligible)
        sig = signal.SIGTERM if rng.random() < 0.25 else signal.SIGKILL  # a stop now and then, mostly a crash
        run = run_streams(node.address, streams, kill=(node, process), kill_after=rng.randrange(0, 20),
                          kill_delay_s=rng.random() * 0.1, sig=sig)
        assert not run.hung() and not run.lost(), (process, sig, run.results)
        assert run.results == undisturbed, (process, sig)
        kills += 1
        wait_restarted(node, process, run.killed_pid)
        wait_for(lambda: len(used_blocks(node)) == 3, timeout_s=30, interval_s=0.2)  # every worker back
    wait_for(lambda: set(used_blocks(node).values()) == {0}, timeout_s=30, interval_s=0.2)
    assert kills >= 10


def test_a_model_that_cannot_load_stops_pdrt_up_at_once_with_its_cause(tmp_path):
    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "no-such-architecture"}')
    started = time.monotonic()
    with pytest.raises(UnavailableError) as failed:
        Node(tmp_path, str(bad)).start()
    assert time.monotonic() - started < 60
    last = failed.value.args[0].strip().splitlines()[-1]
    assert "cannot start" in last and "model_load" in last, last
