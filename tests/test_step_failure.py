"""A step that raises costs the request to blame, never the others: its sequences run alone until the one that
raises again alone fails, and every other request's output still equals transformers' generate.

The faults are injected where no real input reaches (every input that could is refused at admission): the model
runner, or the engine's handling of a sampled token, raises for one request."""

import pytest

from pdrt.engine import SamplingParams
from tests.conftest import MAX_NEW_TOKENS

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=MAX_NEW_TOKENS)


class Poisoned(RuntimeError):
    pass


def run_all(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> tuple[dict, dict]:
    """Run every request to its end; each one's tokens, and each failed one's exception."""
    tokens = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    failed = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        failed.update(engine.take_failed())
    assert not engine.has_unfinished() and not engine.sequences
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked
    return tokens, failed


def poison_runner(engine, when) -> None:
    """The model runner raises for any step whose batch `when(batch)` says is poisoned."""
    run = engine.runner.run

    def run_or_raise(batch):
        if when(batch):
            raise Poisoned("injected")
        return run(batch)

    engine.runner.run = run_or_raise


@pytest.mark.parametrize("chunk", [37, 2048])
def test_a_request_whose_steps_raise_fails_alone_and_the_others_equal_generate(make_engine, references, prompts,
                                                                                chunk):
    engine = make_engine(max_prefill_chunk_size=chunk, speculate="off")
    requests = {f"r{i}": (prompts[i], GREEDY) for i in (2, 5, 9, 12)}
    requests["poison"] = (prompts[7], GREEDY)
    poison_runner(engine, lambda batch: any(seq.request_id == "poison" for seq in batch.sequences()))
    tokens, failed = run_all(engine, requests)
    assert list(failed) == ["poison"] and isinstance(failed["poison"], Poisoned)
    for rid, (prompt, _) in requests.items():
        if rid != "poison":
            assert tokens[rid] == references["llama"].greedy(prompt), rid


def test_a_request_that_raises_mid_answer_fails_and_seeded_streams_sample_on_as_they_would_have(make_engine,
                                                                                                prompts):
    requests = {f"r{i}": (prompts[i], SEEDED if i % 2 else GREEDY) for i in (2, 5, 9, 12)}
    undisturbed, _ = run_all(make_engine(), requests)
    engine = make_engine()
    take = engine._take

    def take_or_raise(seq, new_tokens, logprobs, num_computed=0):
        take(seq, new_tokens, logprobs, num_computed)
        if seq.request_id == "poison" and seq.num_output_tokens >= 4:  # after its token is appended
            raise Poisoned("injected")

    engine._take = take_or_raise
    tokens, failed = run_all(engine, {**requests, "poison": (prompts[7], GREEDY)})
    assert list(failed) == ["poison"]
    assert len(tokens["poison"]) == 3  # what it had emitted before
    assert {rid: tokens[rid] for rid in requests} == undisturbed


def test_a_fault_that_only_batches_raise_ends_every_request_it_meets_and_nothing_hangs(make_engine, prompts):
    engine = make_engine(speculate="off")
    poison_runner(engine, lambda batch: len(batch.sequences()) > 1)
    _, failed = run_all(engine, {f"r{i}": (prompts[i], GREEDY) for i in (2, 5, 9)})
    assert set(failed) == {"r2", "r5", "r9"}
