"""The health indices of DESIGN.md, computed from known inputs."""

import math

import pytest

from pdrt.metrics.health import (
    decoding_smoothness,
    effective_output_tokens_per_worker_hour,
    handoff_efficiency,
    prefill_stability,
)


def test_prefill_stability_is_mean_over_std_and_steady_prefills_pass_the_target():
    assert prefill_stability([1.0, 3.0]) == pytest.approx(2.0)  # mean 2, population std 1
    steady = [0.100, 0.102, 0.098, 0.101, 0.099]
    assert prefill_stability(steady) > 8


def test_prefill_stability_needs_two_prefills_and_is_infinite_without_spread():
    assert math.isnan(prefill_stability([]))
    assert math.isnan(prefill_stability([0.5]))
    assert math.isinf(prefill_stability([0.5, 0.5, 0.5]))


def test_decoding_smoothness_is_std_over_mean_and_a_stutter_fails_the_target():
    assert decoding_smoothness([0.01, 0.03]) == pytest.approx(0.5)
    assert decoding_smoothness([0.010] * 10) == 0.0
    stutter = [0.010] * 9 + [0.050]
    assert decoding_smoothness(stutter) > 0.15


def test_decoding_smoothness_without_enough_steps_is_nan():
    assert math.isnan(decoding_smoothness([0.01]))
    assert math.isnan(decoding_smoothness([0.0, 0.0]))


def test_handoff_efficiency_counts_settled_handoffs_only():
    assert handoff_efficiency(999, 1, 0) == pytest.approx(0.999)
    assert handoff_efficiency(98, 1, 1) == pytest.approx(0.98)
    assert handoff_efficiency(10, 0, 0) == 1.0
    assert math.isnan(handoff_efficiency(0, 0, 0))


def test_effective_output_tokens_per_worker_hour():
    assert effective_output_tokens_per_worker_hour(1000, 3600) == pytest.approx(1000)
    assert effective_output_tokens_per_worker_hour(1000, 2 * 1800) == pytest.approx(1000)  # two workers, half an hour
    assert effective_output_tokens_per_worker_hour(50, 36) == pytest.approx(5000)
    assert math.isnan(effective_output_tokens_per_worker_hour(10, 0))
