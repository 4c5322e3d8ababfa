"""The planner: fits of step times, the simulator's arithmetic on hand-made costs, predictions that order
deployments as their costs say, the per-stream cost fitted back from a loaded node's TPOT, and a profile
measured on the tiny model and read back."""

import pytest

from pdrt.bench import BenchOptions, Slo
from pdrt.bench.workloads import LengthLimits, RequestShape
from pdrt.planner.cost_model import CostModel, StepFit, ThreadsFit, fit_step
from pdrt.planner.overheads import fit_decode_seq, loaded_requests, simulated_tpot
from pdrt.planner.predict import predict
from pdrt.planner.profile import Profile, measure_profile
from pdrt.planner.simulator import Deployment, Overheads, Simulation
from pdrt.worker_profile import CATCH_UP_LATE, SMALL_MODEL_PARAMS

# A prompt costs 1 ms + 10 us a token; a decode step 2 ms + 100 us a sequence; attention free.
COSTS = CostModel({1: ThreadsFit(StepFit(1e-3, 1e-5, 0.0), StepFit(2e-3, 1e-4, 0.0))}, kv_bytes_per_token=0)


def test_a_fit_recovers_the_coefficients_of_exact_samples():
    truth = StepFit(5e-4, 3e-6, 2e-9)
    samples = [(n, a, truth(n, a)) for n in (16, 64, 256, 1024) for a in (0, 1e4, 1e6)]
    fit = fit_step(samples)
    assert fit.fixed == pytest.approx(truth.fixed, rel=1e-6)
    assert fit.per_token == pytest.approx(truth.per_token, rel=1e-6)
    assert fit.per_attention == pytest.approx(truth.per_attention, rel=1e-6)


def test_a_fit_never_has_a_negative_coefficient():
    samples = [(n, 1e6 / n, 1e-3 + 1e-6 * n) for n in (16, 64, 256, 1024)]  # attention anti-correlated: noise
    fit = fit_step(samples)
    assert min(fit.fixed, fit.per_token, fit.per_attention) >= 0


def test_one_request_on_a_disaggregated_node_takes_its_prefill_then_one_step_a_token():
    served = Simulation(COSTS, Deployment(prefill=1, decode=1), cores=2).run([(0.0, RequestShape(100, 5))])[0]
    assert served.first_token == pytest.approx(1e-3 + 1e-3)
    step = 2e-3 + 1e-4
    assert served.finished - served.first_token == pytest.approx(4 * step)


def test_a_colocated_step_pays_its_fixed_cost_once_for_a_chunk_and_the_decodes():
    served = Simulation(COSTS, Deployment(colocated=1, chunk=64), cores=1).run(
        [(0.0, RequestShape(4, 3)), (0.0, RequestShape(100, 2))])
    short, long = served
    assert short.first_token == pytest.approx(1e-3 + 1e-5 * (4 + 64))  # both prompts' first chunks in one step
    # The next step decodes the short one (batch 1) and prefills the long prompt's last 36 tokens: one fixed cost.
    assert long.first_token == pytest.approx(short.first_token + 2e-3 + 1e-4 + 1e-5 * 36)


def test_workers_beyond_the_cores_share_them():
    requests = [(0.0, RequestShape(1000, 1)), (0.0, RequestShape(1000, 1))]
    apart = Simulation(COSTS, Deployment(prefill=2, decode=1), cores=3).run(requests)
    shared = Simulation(COSTS, Deployment(prefill=2, decode=1), cores=1).run(requests)
    assert apart[0].first_token == pytest.approx(11e-3)
    assert shared[0].first_token == pytest.approx(22e-3)


def test_frontend_cpu_delays_tokens_and_takes_cores():
    overheads = Overheads(gateway_token_s=1e-3, client_token_s=1e-3)
    served = Simulation(COSTS, Deployment(prefill=1, decode=1), cores=4, overheads=overheads).run(
        [(0.0, RequestShape(100, 1))])[0]
    assert served.first_token == pytest.approx(2e-3 + 2e-3)


def test_the_cost_a_stream_adds_to_a_step_is_fitted_back_from_the_tpot_it_gives_a_loaded_node():
    truth = Overheads(step_overhead_s=1e-4, decode_seq_s=7e-5, gateway_token_s=3e-5, client_token_s=3e-5)
    loaded = loaded_requests(0.1)
    for cores in (2, 8):  # the node's processes contend for two cores, and do not for eight
        tpot = simulated_tpot(COSTS, truth, cores, loaded)
        fitted = fit_decode_seq(COSTS, Overheads(step_overhead_s=1e-4, gateway_token_s=3e-5, client_token_s=3e-5),
                                cores, loaded, tpot)
        assert fitted == pytest.approx(truth.decode_seq_s, rel=1e-3)
    assert fit_decode_seq(COSTS, truth, 8, loaded, simulated_tpot(COSTS, Overheads(), 8, loaded)) == 0.0


def test_a_slower_host_takes_every_cost_as_much_longer_and_moves_bytes_as_fast():
    slower = COSTS.slower(prefill=2.0, decode=3.0)
    assert slower.prefill_s(100) == pytest.approx(2 * COSTS.prefill_s(100))
    assert slower.decode_step_s(8, 800) == pytest.approx(3 * COSTS.decode_step_s(8, 800))
    overheads = Overheads(step_overhead_s=1e-4, decode_seq_s=5e-5, handoff_s=1e-3, gateway_token_s=2e-5)
    assert overheads.slower(2.0) == Overheads(step_overhead_s=2e-4, decode_seq_s=1e-4, handoff_s=2e-3,
                                              gateway_token_s=4e-5)


def test_more_decode_workers_predict_more_goodput_for_long_answers_and_more_prefill_for_long_prompts():
    options = BenchOptions(duration_s=10, slo=Slo(0.05, 0.01), max_model_len=2048)
    limits = LengthLimits(2048)
    slow_prefill = CostModel({1: ThreadsFit(StepFit(1e-3, 2e-5, 0.0), StepFit(1e-3, 2e-4, 0.0))})

    def goodput(workload: str, prefill: int, decode: int) -> float:
        options.workload = workload
        return predict(slow_prefill, Deployment(prefill=prefill, decode=decode), 8, options, limits).goodput.rate

    assert goodput("code", 1, 2) > goodput("code", 2, 1)
    assert goodput("summarization", 2, 1) > goodput("summarization", 1, 2)


def test_a_profile_of_the_tiny_model_is_measured_saved_and_read_back(model_dirs, tmp_path):
    profile = measure_profile(str(model_dirs["llama"]), threads=[1], max_context=1100, repeats=1)
    assert {n for n, c, _ in profile.prefill[1] if c == 0} == {16, 32, 64, 128, 256, 512, 1024}
    assert {(n, c) for n, c, _ in profile.prefill[1] if c} == {(64, 256), (256, 256), (64, 1024)}
    assert all(s > 0 for *_, s in profile.decode[1])
    back = Profile.load(profile.save(tmp_path / "p.json"))
    assert back.prefill == profile.prefill and back.decode == profile.decode
    costs = back.cost_model()
    assert costs.prefill_s(1024) > costs.prefill_s(16) > 0
    assert costs.decode_step_s(8, 8 * 64) >= costs.decode_step_s(1, 64) > 0


def test_a_prefill_worker_yields_contended_cores_as_its_niceness_says():
    requests = [(0.0, RequestShape(4, 50)), (0.01, RequestShape(1000, 2))]  # a prompt while a stream decodes
    alone = Simulation(COSTS, Deployment(prefill=1, decode=1), cores=2).run(requests)[1]
    contended = Simulation(COSTS, Deployment(prefill=1, decode=1), cores=1).run(requests)[1]
    assert alone.first_token == pytest.approx(0.01 + 11e-3)
    assert contended.first_token - 0.01 > 5 * 11e-3  # at a tenth of the weight until the stream ends
    even = Simulation(COSTS, Deployment(prefill=1, decode=1, prefill_nice=0), cores=1).run(requests)[1]
    assert even.first_token - 0.01 == pytest.approx(2 * 11e-3, rel=0.1)  # an even share: half the core


def test_a_prefill_worker_takes_a_short_prompt_before_a_long_one_that_waited_as_long():
    # As pdrt's engine on a CPU (pdrt/engine/prompt_order.py): the highest response ratio first, not arrival order.
    requests = [(0.0, RequestShape(1000, 2)), (0.001, RequestShape(1000, 2)), (0.002, RequestShape(10, 2))]
    first, long, short = Simulation(COSTS, Deployment(prefill=1, decode=1), cores=2).run(requests)
    assert short.first_token == pytest.approx(first.first_token + 1e-3 + 1e-5 * 10)
    assert long.first_token == pytest.approx(short.first_token + 11e-3)


def test_a_prompt_crawling_at_niceness_10_takes_the_cpu_back_once_its_first_token_is_late():
    requests = [(0.0, RequestShape(4, 200)), (0.01, RequestShape(1000, 2))]  # the stream decodes throughout
    slo = 0.1  # late after 50 ms; the prompt alone takes 11 ms
    small = CostModel(COSTS.fits, 0, num_params=SMALL_MODEL_PARAMS - 1)  # a prefill worker that catches up
    served = Simulation(small, Deployment(prefill=1, decode=1), cores=1, ttft_slo_s=slo).run(requests)[1]
    assert CATCH_UP_LATE * slo < served.first_token - 0.01 < CATCH_UP_LATE * slo + 2 * 11e-3


def test_streams_held_as_the_run_starts_decode_on_their_worker_and_slow_the_newcomers_there():
    held = [[(100, 9)] * 20]  # twenty streams of 100 tokens, nine tokens left each, on the one decode worker
    new = [(0.0, RequestShape(100, 5))]
    alone = Simulation(COSTS, Deployment(prefill=1, decode=1), cores=2).run(new)[0]
    served = Simulation(COSTS, Deployment(prefill=1, decode=1), cores=2).run(new, held)
    assert len(served) == 21  # the held streams come last
    late, first_held = served[0], served[1]
    assert first_held.first_token == 0.0 and first_held.finished == pytest.approx(9 * (2e-3 + 1e-4 * 20), rel=0.3)
    assert late.finished - late.first_token > 1.5 * (alone.finished - alone.first_token)
    with pytest.raises(ValueError, match="2 decode workers"):
        Simulation(COSTS, Deployment(prefill=1, decode=1), cores=2).run(new, [[], []])
