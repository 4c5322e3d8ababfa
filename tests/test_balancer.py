"""The balancer: its predictions follow the load's shape, and it acts on them only with hysteresis, at most
every two intervals, one worker at a time, never emptying a role; on a real node it moves a worker when a
prefill-heavy load arrives and `pdrt status` shows the decision."""

import asyncio
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from pdrt.bench import Slo
from pdrt.control_plane import balancer as balancer_module
from pdrt.control_plane.balancer import (
    HORIZON_S,
    LARGE_GAIN,
    MARGIN,
    MAX_SLOWDOWN,
    MAX_WINDOW_S,
    MIN_REQUESTS,
    PREDICT_NICE,
    SAMPLES,
    SOONER,
    URGENT,
    Balancer,
    Decision,
    Signals,
    held_after_change,
    mix_changed,
    predict_splits,
)
from pdrt.control_plane.registry import Registry
from pdrt.control_plane.role_changes import RoleChanges
from pdrt.metrics.exposition import parse
from pdrt.planner.cost_model import StepFit
from pdrt.planner.profile import Profile, default_profile_path
from pdrt.planner.simulator import Overheads
from pdrt.wire import ChangeRole

SLO = Slo(0.2, 0.02)
LONG_PROMPT_CLIENTS = 12


def hand_made_profile(prefill_per_token_s: float, decode_per_seq_s: float) -> Profile:
    """Step times that follow exact lines (a profile written by hand, not measured)."""
    prefill = StepFit(1e-3, prefill_per_token_s, 0.0)
    decode = StepFit(1e-3, decode_per_seq_s, 0.0)
    return Profile("hand-made", "none", 8, 0, 4096, 1 << 30, measured=False,
                   prefill={1: [(n, c, prefill(n, 0)) for n, c in ((16, 0), (256, 0), (1024, 0), (64, 256))]},
                   decode={1: [(b, b * c, decode(b, 0)) for b in (1, 4, 16, 64) for c in (64, 512)]})


PROFILE = hand_made_profile(2e-5, 5e-4)


def signals(mean_input: float, mean_output: float, prefill: int, decode: int, per_min: float = 1200) -> Signals:
    return Signals(per_min, mean_input, mean_output, 0.5, 0, 0, prefill, decode)


def test_long_prompts_predict_more_prefill_workers_and_long_answers_more_decode_workers():
    prompts = predict_splits(PROFILE, PROFILE.serving_overheads(), signals(4000, 2, 1, 2), SLO, 1, 8, 30)
    answers = predict_splits(PROFILE, PROFILE.serving_overheads(), signals(20, 400, 2, 1, 300), SLO, 1, 8, 30)
    assert prompts.best == (2, 1) and prompts.predicted[(2, 1)] > prompts.predicted[(1, 2)]
    assert answers.best == (1, 2) and answers.predicted[(1, 2)] > answers.predicted[(2, 1)]


class Node:
    """A registry of three split workers and the role changes the balancer starts on it."""

    def __init__(self) -> None:
        self.registry = Registry(lease_s=5)
        for pid, role in (("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")):
            self.registry.register(pid, "i", role, "tcp://x", pid.encode())
        self.sent: list[tuple[bytes, object]] = []
        self.roles = RoleChanges(self.registry, lambda who, m: self.sent.append((who, m)), CollectorRegistry())
        self.balancer = Balancer(self.registry, self.roles, True, 10.0, SLO, 1, 2, Path("/nonexistent"),
                                 CollectorRegistry())


def prefill_heavy(node: Node) -> Signals:
    roles = [e.role for e in node.registry.entries.values()]
    return signals(4000, 2, roles.count("prefill"), roles.count("decode"))


def decision(best: tuple[int, int], gain: float = 0.2) -> Decision:
    """`best` predicted to beat the other split by `gain` (beyond the margin, within LARGE_GAIN unless asked)."""
    other = (1, 2) if best == (2, 1) else (2, 1)
    return Decision(best, {best: 0.9, other: 0.9 - gain})


def test_a_change_waits_for_a_second_evaluation_then_moves_the_least_busy_worker():
    node = Node()
    node.registry.entries["decode-0"].load.num_running = 3
    assert not node.balancer.act(prefill_heavy(node), decision((2, 1)), now=100.0)
    assert node.sent == []
    assert node.balancer.act(prefill_heavy(node), decision((2, 1)), now=110.0)
    assert node.sent == [(b"decode-1", ChangeRole("prefill", node.sent[0][1].reason))]
    assert node.registry.entries["decode-1"].role == "prefill"


def test_the_decode_worker_that_turns_to_prefill_is_the_one_with_the_fewest_tokens_left_to_produce():
    node = Node()
    node.registry.entries["decode-0"].load.num_running, node.registry.entries["decode-0"].load.num_tokens_left = 3, 90
    node.registry.entries["decode-1"].load.num_running, node.registry.entries["decode-1"].load.num_tokens_left = 1, 900
    assert node.balancer.act(prefill_heavy(node), decision((2, 1), gain=LARGE_GAIN + 0.05), now=100.0)
    assert [who for who, _ in node.sent] == [b"decode-0"]


def test_a_large_predicted_gain_is_acted_on_at_once():
    node = Node()
    assert node.balancer.act(prefill_heavy(node), decision((2, 1), gain=LARGE_GAIN + 0.1), now=100.0)
    assert len(node.sent) == 1 and node.registry.entries["decode-0"].role == "prefill"


def test_a_current_split_predicted_to_fail_most_requests_is_left_at_once():
    node = Node()
    assert node.balancer.act(prefill_heavy(node), Decision((2, 1), {(1, 2): URGENT - 0.1, (2, 1): URGENT + 0.05}),
                             now=100.0)
    assert len(node.sent) == 1


def test_a_split_that_serves_a_failing_load_sooner_is_taken_when_none_meets_the_slos():
    node = Node()
    both_fail = {(1, 2): 0.0, (2, 1): 0.0}
    alike = Decision((2, 1), both_fail, {(1, 2): 9.0, (2, 1): 9.0 * (SOONER + 0.05)})
    assert not node.balancer.act(prefill_heavy(node), alike, now=100.0)
    sooner = Decision((2, 1), both_fail, {(1, 2): 9.0, (2, 1): 9.0 * (SOONER - 0.05)})
    assert node.balancer.act(prefill_heavy(node), sooner, now=100.0)
    assert "late x" in node.sent[0][1].reason


def test_a_backlog_no_split_clears_is_predicted_for_the_split_that_drains_it_fastest():
    """Hundreds of long prompts waiting: every split misses the TTFT SLO for almost all of them, two prefill
    workers least late; the balancer moves to them at once."""
    backlog = Signals(600, 4000, 2, 0.0, 400, 0, 1, 2)
    got = predict_splits(PROFILE, PROFILE.serving_overheads(), backlog, SLO, 1, 8, 30)
    assert max(got.predicted.values()) < MARGIN  # no split gains the margin on another
    assert got.best == (2, 1) and got.lateness[(2, 1)] < SOONER * got.lateness[(1, 2)]
    node = Node()
    assert node.balancer.act(backlog, got, now=100.0)


def test_no_second_change_within_two_intervals_nor_while_one_is_under_way():
    node = Node()
    node.balancer.act(prefill_heavy(node), decision((2, 1)), now=100.0)
    node.balancer.act(prefill_heavy(node), decision((2, 1)), now=110.0)
    assert len(node.sent) == 1
    for now in (120.0, 125.0):  # back again: confirmed, but the last change is too recent
        assert not node.balancer.act(prefill_heavy(node), decision((1, 2)), now=now)
    node.roles.pending.clear()
    assert node.balancer.act(prefill_heavy(node), decision((1, 2)), now=131.0)
    assert len(node.sent) == 2


def test_a_gain_within_the_margin_changes_nothing():
    node = Node()
    close = Decision((2, 1), {(1, 2): 0.93, (2, 1): 0.95})
    for now in (100.0, 110.0, 120.0):
        assert not node.balancer.act(prefill_heavy(node), close, now)
    assert node.sent == []


def test_predictions_run_on_a_thread_that_yields_the_cpu_to_the_workers():
    balancer = Node().balancer
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    niceness = balancer.predictor.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    assert niceness.result(timeout=10) == PREDICT_NICE
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # the controller's own thread


def test_without_a_profile_the_balancer_stays_idle_and_says_why():
    node = Node()
    assert not node.balancer.due(node.balancer.next_at + 1)
    assert node.balancer.last._value["action"] == "idle"


def test_a_node_moves_a_decode_worker_to_prefill_under_long_prompts(model_dirs, tmp_path, monkeypatch):
    from pdrt.client import AsyncClient, SamplingParams
    from pdrt.metrics.status_table import summary_lines
    from pdrt.testing.node import Node as RunningNode
    from pdrt.testing.node import free_port
    from tests.system_client import node_status, scrape, wait_for

    monkeypatch.setenv("PDRT_CACHE_DIR", str(tmp_path / "cache"))
    model = str(model_dirs["llama"])
    # A profile written by hand: the node's own steps scale it to what they take here.
    profile = hand_made_profile(1e-4, 5e-4)
    profile.cores = 2
    profile.save(default_profile_path(model))
    metrics_port = free_port()
    with RunningNode(tmp_path, model, extra={"decode": {"count": 2}, "gateway": {"ttft_slo_s": 0.2, "tpot_slo_s": 0.05},
                                              "controller": {"balance_interval_s": 1.0, "metrics_port": metrics_port},
                                              "experimental": {"local_prefill_max_tokens": 0}},
                     ) as node:
        node.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        moved = asyncio.Event()

        async def prompts(client: AsyncClient, first: int) -> None:
            # Long prompts back to back from LONG_PROMPT_CLIENTS at once: the one prefill worker always has a
            # queue, whatever its speed.
            for i in range(first, 100 * LONG_PROMPT_CLIENTS, LONG_PROMPT_CLIENTS):
                if moved.is_set():
                    return
                tokens = [(i * 7 + j) % 900 + 5 for j in range(900)]
                await client.generate(token_ids=tokens, params=SamplingParams(max_tokens=2, ignore_eos=True))

        async def watch() -> None:
            for _ in range(120):
                roles = [w.role for w in (await asyncio.to_thread(node_status, node)).workers]
                if roles.count("prefill") == 2:
                    break
                await asyncio.sleep(0.5)
            moved.set()

        async def load() -> None:
            async with AsyncClient(node.address) as client:
                await asyncio.gather(watch(), *(prompts(client, k) for k in range(LONG_PROMPT_CLIENTS)))

        asyncio.run(load())
        try:
            wait_for(lambda: sorted(w.role for w in node_status(node).workers) == ["decode", "prefill", "prefill"],
                     timeout_s=20, interval_s=0.5)
        except AssertionError:  # say what the balancer saw and decided last
            said = [line for line in summary_lines(scrape(node)[1]) if line.startswith(("balancer", "last role"))]
            raise AssertionError(f"no decode worker moved to prefill; {said}") from None
        lines = wait_for(lambda: [line for line in summary_lines(scrape(node)[1])
                                  if line.startswith("last role change: decode-") and "-> prefill" in line],
                         timeout_s=10, interval_s=0.5)
        assert "balancer: predicted" in lines[0]
        assert any(line.startswith("balancer at ") for line in summary_lines(scrape(node)[1]))


def test_a_prediction_is_the_mean_over_draws_of_the_arrivals_ahead(monkeypatch):
    # 2P+1D at its knee: one decode worker holding twenty streams as long answers keep coming; one draw's burst
    # or lull swings its attainment by tens of points.
    knee = Signals(285, 64, 400, 1.0, 0, 20, 2, 1, mean_left=250, held=(20,))
    mean = predict_splits(PROFILE, PROFILE.serving_overheads(), knee, SLO, 1, 8, 30)
    monkeypatch.setattr(balancer_module, "SAMPLES", 1)
    draws = [predict_splits(PROFILE, PROFILE.serving_overheads(), knee, SLO, 1, 8, 30, seed=s)
             for s in range(SAMPLES)]
    assert max(d.predicted[(2, 1)] for d in draws) - min(d.predicted[(2, 1)] for d in draws) > 0.2
    for split in mean.predicted:
        assert mean.predicted[split] == pytest.approx(sum(d.predicted[split] for d in draws) / SAMPLES)


def test_decode_steps_of_enough_streams_slower_than_the_profile_make_decode_workers_worth_more():
    quiet = predict_splits(PROFILE, PROFILE.serving_overheads(), Signals(120, 64, 400, 1.0, 0, 0, 2, 1), SLO, 1, 8, 30)
    # The one decode worker's 5 streams step three times as slowly as the profile says they would.
    step = PROFILE.cost_model().decode_step_s(5, 5 * (64 + 400 // 2))
    loaded = predict_splits(PROFILE, PROFILE.serving_overheads(),
                            Signals(120, 64, 400, 1.0, 0, 0, 2, 1, decode_steps=((5, 3 * step),)), SLO, 1, 8, 30)
    assert quiet.best == (2, 1) and quiet.predicted[(2, 1)] > 0.9  # the current split will do
    assert loaded.best == (1, 2) and loaded.predicted[(1, 2)] - loaded.predicted[(2, 1)] > 0.5
    # Two streams stepping four times as slowly say nothing of decode's speed (a prompt held the core meanwhile).
    few = predict_splits(PROFILE, PROFILE.serving_overheads(),
                         Signals(120, 64, 400, 1.0, 0, 0, 2, 1, decode_steps=((2, 4 * step),)), SLO, 1, 8, 30)
    assert few.predicted == quiet.predicted
    # Steps as long as the model's plus what serving adds to them are as the simulator makes them: no slowdown.
    serving = Overheads(step_overhead_s=1e-3, decode_seq_s=2e-4)
    as_simulated = predict_splits(PROFILE, serving, Signals(120, 64, 400, 1.0, 0, 0, 2, 1,
                                                            decode_steps=((5, step + 1e-3 + 5 * 2e-4),)), SLO, 1, 8, 30)
    assert as_simulated.slowdown == 1.0 and loaded.slowdown == pytest.approx(3.0)



def test_prompts_slower_than_the_profile_make_prefill_workers_worth_more():
    # 1200 prompts a minute of 1024 tokens: the one prefill worker keeps up at the profile's speed, not at half.
    costs, overheads = PROFILE.cost_model(), PROFILE.serving_overheads()

    def load(step_tokens: int, times_slower: float) -> Signals:
        rate = step_tokens / (times_slower * (costs.prefill_s(step_tokens, 0) + overheads.step_overhead_s))
        return Signals(1200, 1024, 16, 1.0, 0, 0, 1, 2, prefill_steps=((step_tokens, rate),))

    as_profiled = predict_splits(PROFILE, overheads, load(512, 1.0), SLO, 1, 8, 30)
    slow = predict_splits(PROFILE, overheads, load(512, 2.0), SLO, 1, 8, 30)
    assert as_profiled.prefill_slowdown == 1.0  # 1P+2D holds: nothing gains the margin on it
    assert max(as_profiled.predicted.values()) - as_profiled.predicted[(1, 2)] < MARGIN
    assert slow.prefill_slowdown == pytest.approx(2.0)
    assert slow.best == (2, 1) and slow.predicted[(2, 1)] - slow.predicted[(1, 2)] > 0.2
    # Steps of short prompts are mostly fixed cost: they say nothing of the prompts' speed.
    assert predict_splits(PROFILE, overheads, load(64, 4.0), SLO, 1, 8, 30).predicted == as_profiled.predicted


def test_steps_faster_than_the_profile_make_a_worker_hold_more_and_no_ratio_goes_past_its_bound():
    # 600 requests a minute of 400-token answers: past one decode worker at the profile's speed, not at a third.
    costs, serving = PROFILE.cost_model(), Overheads(step_overhead_s=1e-3, decode_seq_s=2e-4)

    def load(times_slower: float) -> Signals:
        step = costs.decode_step_s(8, 8 * (64 + 400 // 2)) + 1e-3 + 8 * 2e-4
        return Signals(600, 64, 400, 1.0, 0, 0, 2, 1, decode_steps=((8, times_slower * step),))

    as_profiled = predict_splits(PROFILE, serving, load(1.0), SLO, 1, 8, 30)
    fast = predict_splits(PROFILE, serving, load(1 / 3), SLO, 1, 8, 30)
    assert as_profiled.slowdown == 1.0 and fast.slowdown == pytest.approx(1 / 3)
    assert fast.predicted[(2, 1)] > as_profiled.predicted[(2, 1)] + 0.3
    assert predict_splits(PROFILE, serving, load(1e-3), SLO, 1, 8, 30).slowdown == pytest.approx(1 / MAX_SLOWDOWN)
    assert predict_splits(PROFILE, serving, load(1e3), SLO, 1, 8, 30).slowdown == pytest.approx(MAX_SLOWDOWN)


def test_a_prediction_stops_when_the_mix_changes_under_it_and_the_next_one_starts_at_once():
    node = Node()
    balancer = node.balancer
    balancer.profile, balancer.interval_s = PROFILE, 0.4
    counters = dict(NO_REQUESTS)
    balancer.sample(gateway_counters(**counters), now=0.0)
    # Short prompts and long answers (those that ended used all they asked for) ...
    counters |= dict(started_requests_total=10, started_prompt_tokens_total=640, started_max_tokens_total=11_000,
                     requests_total=5, output_tokens_total=5500, max_tokens_total=5500)
    balancer.sample(gateway_counters(**counters), now=10.0)
    busy = threading.Event()
    balancer.predictor.submit(busy.wait, 10)  # the prediction waits its turn, as behind a slow one

    async def shift() -> bool:
        evaluation = asyncio.create_task(balancer.evaluate())
        await asyncio.sleep(0.05)
        # ... then long prompts and short answers start while it is predicted.
        balancer.sample(gateway_counters(**counters | dict(
            started_requests_total=20, started_prompt_tokens_total=14_640, started_max_tokens_total=11_160)),
            now=20.0)
        await asyncio.sleep(0.3)  # the evaluation looks at the signals every quarter interval
        busy.set()
        return await asyncio.wait_for(evaluation, timeout=30)

    assert not asyncio.run(shift())
    assert node.sent == [] and not balancer.evaluating
    assert balancer.next_at <= time.monotonic()  # the next evaluation is due at the next tick
    families = list(balancer.decisions.collect())
    assert [s.value for f in families for s in f.samples
            if s.name.endswith("_total") and s.labels.get("action") == "restart"] == [1.0]
    assert mix_changed(signals(64, 1100, 1, 2), signals(1400, 16, 1, 2))
    assert not mix_changed(signals(1400, 16, 2, 1), signals(1300, 20, 2, 1))
    assert predict_splits(PROFILE, PROFILE.serving_overheads(), signals(64, 1100, 1, 2), SLO, 1, 8, 30,
                          cancelled=lambda: True) is None


def test_the_prediction_looks_ahead_two_lifetimes_of_a_stream_two_intervals_and_half_a_minute_at_least():
    balancer = Node().balancer  # interval 10 s, TPOT SLO 20 ms
    assert balancer.horizon_s(signals(64, 100, 1, 2)) == HORIZON_S  # streams of 2 s
    assert balancer.horizon_s(signals(64, 1000, 1, 2)) == 40.0  # streams of 20 s at the SLO's pace: two of them
    balancer.interval_s = 25.0
    assert balancer.horizon_s(signals(64, 100, 1, 2)) == 50.0  # two intervals


# The gateways' counters before any request (pdrt_gateway_<name>).
NO_REQUESTS = dict(started_requests_total=0, started_prompt_tokens_total=0, started_max_tokens_total=0,
                   streamed_tokens_total=0, requests_total=0, output_tokens_total=0, max_tokens_total=0)


def gateway_counters(**values: float) -> list:
    """The gateways' metrics as the controller reads them: `name=value` for each pdrt_gateway_<name>."""
    return parse("".join(f"pdrt_gateway_{name} {value}\n" for name, value in values.items()).encode())


def test_the_answer_length_is_read_ahead_from_what_requests_ask_for_at_the_share_ended_ones_used():
    balancer = Node().balancer
    start = dict(NO_REQUESTS)
    balancer.sample(gateway_counters(**start), now=0.0)
    # Ten long answers start (1000 tokens asked for each), 50 tokens streamed so far; no request ended yet.
    started = start | dict(started_requests_total=10, started_prompt_tokens_total=640,
                           started_max_tokens_total=10_000, streamed_tokens_total=50)
    balancer.sample(gateway_counters(**started), now=5.0)
    assert balancer.signals().mean_output == 5.0  # until one ends, tokens streamed per request started
    # Requests that ended used half of what they asked for: the answers now starting are read as 500 tokens,
    # and the streams open as running on for half of what they may still produce.
    ended = started | dict(requests_total=MIN_REQUESTS, output_tokens_total=100, max_tokens_total=200,
                           open_requests=10, open_answer_tokens_left=9000)
    balancer.sample(gateway_counters(**ended), now=8.0)
    got = balancer.signals()
    assert got.mean_output == 500.0 and got.mean_left == 450.0


def test_streams_held_stay_on_their_workers_through_a_change_and_those_of_a_leaving_worker_go_to_the_fewest():
    streams = [(100, 50)] * 40
    assert [len(s) for s in held_after_change(streams, [10, 30], 3)] == [15, 10, 15]  # the crowded one sheds half
    assert [len(s) for s in held_after_change(streams[:1], [1], 2)] == [1, 0]  # too few to move
    assert [len(s) for s in held_after_change([], [0], 2)] == [0, 0]
    assert [len(s) for s in held_after_change(streams, [10, 30], 2)] == [30, 10]
    assert [len(s) for s in held_after_change(streams, [25, 3, 12], 2)] == [25, 15]  # the least busy one leaves


def test_a_crowded_decode_worker_is_predicted_to_stay_crowded():
    """Streams already on the one decode worker weigh on 2P+1D, not on a split that adds a decode worker."""
    empty = Signals(120, 64, 400, 1.0, 0, 0, 2, 1)
    crowded = Signals(120, 64, 400, 1.0, 0, 60, 2, 1, held=(60,), mean_left=300)
    quiet = predict_splits(PROFILE, PROFILE.serving_overheads(), empty, SLO, 1, 8, 30)
    loaded = predict_splits(PROFILE, PROFILE.serving_overheads(), crowded, SLO, 1, 8, 30)
    assert quiet.best == (2, 1)
    assert loaded.best == (1, 2) and loaded.predicted[(2, 1)] < quiet.predicted[(2, 1)] - 0.3


def test_lengths_come_from_the_last_interval_when_enough_requests_started_in_it():
    balancer = Node().balancer  # interval 10 s
    counters = dict(NO_REQUESTS)
    balancer.sample(gateway_counters(**counters), now=0.0)
    # Ten long prompts in the first interval, then ten short ones: the load now is short prompts.
    counters |= dict(started_requests_total=10, started_prompt_tokens_total=14_000, started_max_tokens_total=160)
    balancer.sample(gateway_counters(**counters), now=10.0)
    counters |= dict(started_requests_total=20, started_prompt_tokens_total=14_640, started_max_tokens_total=11_160,
                     requests_total=10, output_tokens_total=160, max_tokens_total=160)
    balancer.sample(gateway_counters(**counters), now=20.0)
    got = balancer.signals()
    assert got.mean_input == 64.0 and got.mean_output == 1100.0
    assert got.requests_per_min == 60.0  # the rate over the whole window


def test_the_newest_requests_of_another_mix_are_read_at_once_and_evaluated_before_the_interval_is_up():
    balancer = Node().balancer  # interval 10 s
    balancer.profile = PROFILE
    counters = dict(NO_REQUESTS)
    balancer.sample(gateway_counters(**counters), now=0.0)
    # Long prompts, short answers (all used) for ten seconds: evaluated.
    counters |= dict(started_requests_total=10, started_prompt_tokens_total=14_000, started_max_tokens_total=160,
                     requests_total=10, output_tokens_total=160, max_tokens_total=160)
    balancer.sample(gateway_counters(**counters), now=10.0)
    balancer.evaluated, balancer.next_at = balancer.signals(), 20.0
    assert balancer.evaluated.mean_input == 1400.0
    # Two short prompts start: too few to tell a shift; nothing is due before the interval is up.
    counters |= dict(started_requests_total=12, started_prompt_tokens_total=14_128, started_max_tokens_total=2360)
    balancer.sample(gateway_counters(**counters), now=12.5)
    assert balancer.signals().mean_input > 1000 and not balancer.due(12.5)
    # A third: the three newest are read as the load, and it is evaluated now.
    counters |= dict(started_requests_total=13, started_prompt_tokens_total=14_192, started_max_tokens_total=3460)
    balancer.sample(gateway_counters(**counters), now=15.0)
    got = balancer.signals()
    assert (got.mean_input, got.mean_output) == (64.0, 1100.0)
    assert balancer.due(15.0) and balancer.next_at == 25.0
    balancer.evaluated = got
    assert not balancer.due(15.5)  # once: that load is the one evaluated now


def test_at_a_low_rate_the_window_stretches_back_until_enough_requests_started_in_it():
    balancer = Node().balancer  # interval 10 s: two intervals hold 2 requests at 0.1 requests/s
    counters = dict(NO_REQUESTS)
    for second in range(0, 71, 5):
        started = second // 10
        balancer.sample(gateway_counters(**counters | dict(
            started_requests_total=started, started_prompt_tokens_total=100 * started,
            started_max_tokens_total=50 * started)), now=float(second))
        if second == 60:  # six started: the window holds five of them, over 45 s
            got = balancer.signals()
            assert got is not None and got.mean_input == 100.0
            assert balancer.samples[-1][0] - balancer.samples[0][0] == 45.0 and got.requests_per_min == 60 * 5 / 45
    assert balancer.samples[-1][0] - balancer.samples[0][0] <= MAX_WINDOW_S  # not beyond


def predicted_as(monkeypatch, by_prefill: dict[int, tuple[float, float]]) -> None:
    """The simulator replaced: a split of P prefill workers attains by_prefill[P][0], by_prefill[P][1] times late."""
    def simulate(costs, deployment, *args, **kwargs):
        attainment, late = by_prefill[deployment.prefill]
        return SimpleNamespace(attainment=attainment, ttft=SimpleNamespace(p90=late * SLO.ttft_s),
                               tpot=SimpleNamespace(p90=0.0))

    monkeypatch.setattr(balancer_module, "simulate", simulate)


def test_where_every_split_fails_most_requests_the_one_attaining_far_more_still_wins(monkeypatch):
    """1P+2D is predicted 21% and sixteen times late (prompts slowed by the streams), 2P+1D 4% and twice late:
    attainment that far apart is not noise, and 1P+2D stays."""
    predicted_as(monkeypatch, {1: (0.21, 15.7), 2: (0.04, 1.9)})
    signals = Signals(57, 66, 660, 1.0, 10, 12, 1, 2)
    got = predict_splits(PROFILE, PROFILE.serving_overheads(), signals, SLO, 1, 8, 30)
    assert got.best == (1, 2)
    assert not Node().balancer.act(signals, got, now=100.0)


def test_where_every_split_fails_most_requests_a_point_of_attainment_does_not_outweigh_serving_them_sooner(
        monkeypatch):
    """Long prompts queue behind the streams of a decode-heavy phase: 1P+2D is predicted 1% and nine times late,
    2P+1D 0% and three and a half times late. The balancer moves to 2P+1D, at once."""
    predicted_as(monkeypatch, {1: (0.01, 8.6), 2: (0.0, 3.5)})
    signals = Signals(48, 1400, 16, 0.3, 12, 22, 1, 2)
    got = predict_splits(PROFILE, PROFILE.serving_overheads(), signals, SLO, 1, 8, 30)
    assert got.predicted[(1, 2)] > got.predicted[(2, 1)] and got.best == (2, 1)
    assert Node().balancer.act(signals, got, now=100.0)
