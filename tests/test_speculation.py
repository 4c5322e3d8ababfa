"""Speculative decoding in the engine, against transformers' generate and against itself with speculation off:
greedy outputs equal token for token whatever is proposed, seeded sampling gives the same tokens on and off,
stops inside a run of kept proposals, rejected proposals leave no block held and no prefix-cache entry, the gate
and the proposers."""

import pytest

from pdrt.engine import SamplingParams
from pdrt.engine.proposers import MAX_PROPOSAL, DraftModel, PromptLookup
from pdrt.engine.sequence import Sequence
from pdrt.engine.spec_gate import PROBE_EVERY, REFIT_EVERY, SeqStats, SpecGate, StepCost

LONG = 40


class Scripted:
    """Proposes each request's true continuation (its output with speculation off), wrong at every
    `wrong_every`-th output index: a proposer whose proposals are kept in part, in whole, or not at all."""

    def __init__(self, expected: dict[str, list[int]], prompt_lengths: dict[str, int], wrong_every: int = 3) -> None:
        self.expected, self.prompt_lengths, self.wrong_every = expected, prompt_lengths, wrong_every

    def _rest(self, seq: Sequence) -> list[int]:
        return self.expected[seq.request_id][seq.output_index:]

    def available(self, seq: Sequence) -> int:
        return min(MAX_PROPOSAL, len(self._rest(seq)))

    def propose(self, seq: Sequence, k: int) -> list[int]:
        start = seq.output_index
        return [(t + 1) % 1000 if (start + i) % self.wrong_every == self.wrong_every - 1 else t
                for i, t in enumerate(self._rest(seq)[:k])]

    def forget(self, request_id: str) -> None:
        pass


def run(engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[int]]:
    results = {}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
        results[f"r{i}"] = []
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id].extend(out.new_token_ids)
    return results


def assert_nothing_left(engine, outputs: dict[str, list[int]], prompts: list[list[int]]) -> None:
    """Every block free, and every block in the prefix cache holds tokens some request really had there."""
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    bs = manager.block_size
    real = set()
    for i, prompt in enumerate(prompts):
        tokens = prompt + outputs[f"r{i}"]
        real |= {tuple(tokens[j : j + bs]) for j in range(0, len(tokens) - bs + 1, bs)}
    for block_id in manager.cached.values():
        assert tuple(manager.blocks[block_id].token_ids) in real


def test_prompt_lookup_speculation_equals_generate(make_engine, references, prompts):
    engine = make_engine()
    assert engine.speculator is not None  # on by default
    greedy = SamplingParams(temperature=0, max_tokens=LONG)
    outputs = run(engine, prompts, [greedy] * len(prompts))
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == references["llama"].greedy(prompt, LONG), f"prompt of {len(prompt)} tokens"
    assert engine.speculator.num_proposed > 0  # (a random model seldom repeats itself: test_smollm2.py keeps some)
    assert_nothing_left(engine, outputs, prompts)


@pytest.mark.parametrize("wrong_every", [1, 3, 1000])  # nothing kept; parts kept; everything kept
def test_whatever_is_proposed_greedy_and_seeded_outputs_equal_speculation_off(make_engine, prompts, wrong_every):
    chosen = prompts[2:14]
    params = [SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=LONG, ignore_eos=True)
              for i in range(len(chosen))]
    expected = run(make_engine(speculate="off"), chosen, params)
    engine = make_engine()
    engine.speculator.proposer = Scripted(expected, {f"r{i}": len(p) for i, p in enumerate(chosen)}, wrong_every)
    assert run(engine, chosen, params) == expected
    spec = engine.speculator
    assert spec.num_proposed > 0
    if wrong_every == 1:
        assert spec.num_accepted == 0
    elif wrong_every == 1000:
        assert spec.num_accepted == spec.num_proposed
    else:
        assert 0 < spec.num_accepted < spec.num_proposed
    assert_nothing_left(engine, expected, chosen)


def test_a_stop_inside_kept_proposals_ends_the_output_where_it_would_have(make_engine, prompts, tokenizer):
    prompt = prompts[8]
    free = run(make_engine(speculate="off"), [prompt], [SamplingParams(temperature=0, max_tokens=LONG)])["r0"]
    stop_token = free[LONG // 2]
    stop_text = tokenizer.decode(free[LONG // 3 : LONG // 3 + 2])
    for params in (SamplingParams(temperature=0, max_tokens=LONG, stop_token_ids=[stop_token]),
                   SamplingParams(temperature=0, max_tokens=LONG, stop=[stop_text]),
                   SamplingParams(temperature=0, max_tokens=LONG // 2 + 3, logprobs=True)):
        expected = outputs(make_engine(speculate="off"), prompt, params)
        engine = make_engine()
        engine.speculator.proposer = Scripted({"r0": free}, {"r0": len(prompt)}, wrong_every=1000)
        got = outputs(engine, prompt, params)
        assert [t for o in got for t in o.new_token_ids] == [t for o in expected for t in o.new_token_ids]
        assert (got[-1].finished, got[-1].finish_reason, got[-1].stop_reason) == \
            (True, expected[-1].finish_reason, expected[-1].stop_reason)
        if params.logprobs:
            assert [x for o in got for x in o.new_logprobs] == \
                pytest.approx([x for o in expected for x in o.new_logprobs], abs=1e-4)
        assert max(len(o.new_token_ids) for o in got) > 1  # several tokens came at once
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def outputs(engine, prompt, params):
    engine.add_request("r0", prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_a_request_that_opts_out_is_never_speculated(make_engine, prompts):
    engine = make_engine()
    engine.speculator.proposer = Scripted({"r0": [1] * LONG}, {"r0": len(prompts[5])})
    run(engine, [prompts[5]], [SamplingParams(temperature=0, max_tokens=LONG, speculate=False)])
    assert engine.speculator.num_proposed == 0


def test_a_draft_model_proposes_and_the_output_equals_generate(make_engine, references, prompts, model_dirs):
    engine = make_engine(speculate=str(model_dirs["llama"]))  # the target as its own draft: all kept
    assert isinstance(engine.speculator.proposer, DraftModel)
    chosen = prompts[3:9]
    outputs = run(engine, chosen, [SamplingParams(temperature=0, max_tokens=LONG)] * len(chosen))
    for i, prompt in enumerate(chosen):
        assert outputs[f"r{i}"] == references["llama"].greedy(prompt, LONG)
    spec = engine.speculator
    assert spec.num_proposed > 0 and spec.num_accepted >= 0.9 * spec.num_proposed


def test_a_draft_model_of_another_vocabulary_is_refused_as_a_config_no_restart_mends(make_engine, model_dirs):
    from pdrt.errors import ConfigError
    from pdrt.testing.tiny_model import build_tiny_model

    with pytest.raises(ConfigError, match="vocabulary"):
        make_engine(speculate=str(build_tiny_model(model_dirs["llama"].parent / "v512", vocab_size=512)))


def test_prompt_lookup_proposes_what_followed_the_last_ngram():
    lookup = PromptLookup()
    seq = Sequence("a", [5, 6, 7, 8, 9, 1, 2, 6, 7], 9, SamplingParams(), 0)
    assert lookup.available(seq) == 6  # "6 7" ended at index 3: 8 9 1 2 6 7 follow
    assert lookup.propose(seq, 3) == [8, 9, 1]
    seq.token_ids += [3]  # "7 3" never came before
    assert lookup.available(seq) == 0
    seq.token_ids += [5, 6, 7]  # "5 6 7": the longest match, the first one
    assert lookup.available(seq) >= 1 and lookup.propose(seq, 2) == [8, 9]


def test_the_step_cost_is_fitted_on_steps_that_vary():
    cost = StepCost(0.010, 0.001)
    for _ in range(REFIT_EVERY):
        cost.observe(1, 1, 0.02)
    assert (cost.fixed_s, cost.per_row_s) == (0.010, 0.001)  # no spread yet: the prior stands
    cost = StepCost(0.010, 0.001)
    for batch in [1, 5, 9] * (REFIT_EVERY // 3 + 1):  # fitted once REFIT_EVERY steps are in
        cost.observe(batch, batch, 0.02 + 0.002 * batch)
    assert (cost.fixed_s, cost.per_row_s) == (pytest.approx(0.02), pytest.approx(0.002))
    assert cost.at(10) == (pytest.approx(0.04), pytest.approx(0.002))


def test_a_batch_size_is_priced_by_its_own_steps_where_its_first_rows_cost_most():
    """Batch 8 on a CPU: the line through batch-1 and batch-8 steps says a row costs 1 ms, where at batch 8 the
    first rows past the batch cost 5 ms each (the attention threads fall out of balance), and the gate that
    believed the line would verify proposals that do not pay there."""
    cost = StepCost(0.040, 0.001)
    steps = [(1, 1, 0.041), (1, 3, 0.043), (8, 8, 0.048), (8, 9, 0.053), (8, 10, 0.058)]
    for _ in range(4 * REFIT_EVERY // len(steps) + 1):
        for step in steps:
            cost.observe(*step)
    assert cost.at(8) == (pytest.approx(0.048), pytest.approx(0.005))
    assert cost.at(1) == (pytest.approx(cost.fixed_s + cost.per_row_s), pytest.approx(cost.per_row_s))
    assert cost.per_row_s < 0.002  # the line, for a batch without its own steps
    streams = {f"s{i}": 8 for i in range(8)}
    for priced_by, expected_rows in ((StepCost(cost.fixed_s, cost.per_row_s), 8), (cost, 0)):
        gate = SpecGate(priced_by)
        gate.stats = {s: SeqStats(rate=0.45) for s in streams}  # pays at 1 ms a row (0.45 * 48 > 8), not at 5
        assert sum(gate.draft_lengths(streams, 8, 100).values()) == expected_rows


def test_the_gate_speculates_where_rows_are_cheap_and_not_where_each_costs_a_token():
    cheap = SpecGate(StepCost(0.020, 0.0005))  # weights read dominate: a row costs 1/40 of a step
    lengths = cheap.draft_lengths({"a": 8}, base_rows=1, budget=100)
    assert lengths["a"] >= 4
    dear = SpecGate(StepCost(0.001, 0.002))  # arithmetic dominates: a row costs as much as a token
    assert dear.draft_lengths({s: 8 for s in "abcdefgh"}, base_rows=8, budget=100) == dict.fromkeys("abcdefgh", 0)


def test_acceptance_and_confidence_shorten_the_draft_and_a_left_out_sequence_is_probed():
    gate = SpecGate(StepCost(0.020, 0.002))
    confident = gate.draft_lengths({"a": 8}, 1, 100)["a"]
    for _ in range(10):
        gate.verified("a", 4, 0)  # never kept
    assert gate.draft_lengths({"a": 8}, 1, 100)["a"] < confident
    gate = SpecGate(StepCost(0.020, 0.002))
    for _ in range(10):
        gate.distribution("b", 0.05)  # a sampled sequence whose model is unsure of every token
    lengths = [gate.draft_lengths({"b": 8}, 1, 100)["b"] for _ in range(PROBE_EVERY)]
    assert lengths[:-1] == [0] * (PROBE_EVERY - 1) and lengths[-1] == 1


def test_probes_are_spread_out_where_rows_are_dear_so_that_they_cost_little():
    cheap = SpecGate(StepCost(0.020, 0.0005))  # batch 1, weights read dominate: probing every PROBE_EVERY pays
    assert cheap.probe_every(1, 1) == PROBE_EVERY
    dear = SpecGate(StepCost(0.002, 0.006))  # batch 8 on a CPU: a row costs nearly a stream's token
    every = dear.probe_every(8, 8)
    assert every > 4 * PROBE_EVERY
    streams = {f"s{i}": 8 for i in range(8)}
    probes = sum(sum(dear.draft_lengths(streams, 8, 100).values()) for _ in range(every))
    assert probes == 8  # each stream probed once in `every` steps: 8 rows over steps of 8 rows, at most 1% more
