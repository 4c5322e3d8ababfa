"""A worker's own measures of its steps, as its load reports them to the gateways."""

import time

from prometheus_client import generate_latest

from pdrt.engine.sampling_params import SamplingParams
from pdrt.metrics.worker_metrics import WorkerMetrics
from pdrt.wire import Load

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def step(engine, metrics: WorkerMetrics) -> None:
    started = time.perf_counter()
    engine.step()
    metrics.stepped(started)


def test_the_load_gives_the_mean_of_recent_decoding_steps_with_and_without_prefills(make_engine, prompts):
    engine = make_engine()
    metrics = WorkerMetrics("decode", engine, Load)
    assert metrics.step_times() == (0.0, 0.0)
    engine.add_request("a", prompts[3], PARAMS)
    step(engine, metrics)  # a prefill alone decodes nothing: not counted
    assert metrics.step_times() == (0.0, 0.0)
    step(engine, metrics)
    step(engine, metrics)
    engine.add_request("b", prompts[15], PARAMS)  # 700 tokens: its step takes longer than a decode
    step(engine, metrics)
    assert [prefilled for _, prefilled in metrics.recent_steps] == [False, False, True]
    mean, plain = metrics.step_times()
    seconds = [s for s, _ in metrics.recent_steps]
    assert mean == sum(seconds) / 3 and plain == sum(seconds[:2]) / 2
    assert mean > plain


def test_demotions_and_demoted_streams_are_exposed(make_engine, prompts):
    engine = make_engine()
    metrics = WorkerMetrics("decode", engine, Load)
    engine.add_request("a", prompts[3], PARAMS)
    engine.add_request("b", prompts[15], PARAMS)
    engine.step()
    engine.scheduler.demote(engine.sequences["b"], 2)
    text = generate_latest(metrics.registry).decode()
    assert "pdrt_worker_demotions_total 1.0" in text and "pdrt_worker_demoted_streams 1.0" in text
    engine.scheduler.promote(engine.sequences["b"])
    text = generate_latest(metrics.registry).decode()
    assert "pdrt_worker_promotions_total 1.0" in text and "pdrt_worker_demoted_streams 0.0" in text
