"""The sampler: top-k and top-p filters on known tensors, seeded sampling, stop strings and logprobs."""

import math
from dataclasses import dataclass, field

import torch

from pdrt.engine import FinishReason, LLMEngine, RequestOutput, SamplingParams
from pdrt.engine.sampler import apply_top_k, apply_top_p


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Result]:
    """Add every request, step to completion and gather each one's tokens, logprobs and outputs."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    results = {request_id: Result() for request_id in requests}
    while engine.has_unfinished():
        for out in engine.step():
            result = results[out.request_id]
            result.tokens.extend(out.new_token_ids)
            result.logprobs.extend(out.new_logprobs or [])
            result.outputs.append(out)
    return results


def sampled(seed: int, **overrides) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "seed": seed, "max_tokens": 16, **overrides})


GREEDY = SamplingParams(temperature=0, max_tokens=16)


# -- filters on known tensors ---------------------------------------------


def test_top_k_keeps_exactly_the_k_largest_of_each_row():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0],
                           [4.0, 3.0, 2.0, 1.0],
                           [0.5, 0.1, 0.9, 0.3]])
    kept = apply_top_k(logits, torch.tensor([2, 0, 1])).isfinite()
    assert kept.tolist() == [[False, True, True, False],
                             [True, True, True, True],
                             [False, False, True, False]]


def test_top_k_leaves_the_kept_logits_unchanged():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    filtered = apply_top_k(logits, torch.tensor([3]))
    assert filtered[0, 1:].tolist() == [4.0, 3.0, 2.0]
    assert filtered[0, 0] == float("-inf")


def test_top_k_larger_than_the_vocabulary_keeps_all():
    logits = torch.tensor([[1.0, 4.0, 3.0]])
    assert apply_top_k(logits, torch.tensor([10])).isfinite().all()


def test_top_p_keeps_the_smallest_set_of_likely_tokens_that_reaches_p():
    # Each row holds probabilities 0.5, 0.3, 0.15, 0.05, shuffled so that the
    # filter has to map its decision back from sorted order.
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    logits = probs.log().expand(4, -1)
    kept = apply_top_p(logits, torch.tensor([0.7, 0.85, 0.96, 1.0])).isfinite()
    assert kept.tolist() == [[False, True, False, True],
                             [True, True, False, True],
                             [True, True, True, True],
                             [True, True, True, True]]


def test_top_p_always_keeps_the_most_likely_token():
    logits = torch.tensor([[0.0, 1.0, 0.5], [3.0, 2.9, 2.8]])
    kept = apply_top_p(logits, torch.tensor([1e-6, 0.2])).isfinite()
    assert kept.tolist() == [[False, True, False], [True, False, False]]


# -- through the engine ---------------------------------------------------


def test_same_seed_gives_same_tokens_in_any_batch(make_engine, prompts):
    target = prompts[4]
    alone = make_engine().generate([target], sampled(seed=7))[0]
    # Another engine, smaller chunks, and neighbours that are greedy, seeded
    # with top-p or top-k: the target's row and its batch differ every step.
    busy = make_engine(max_prefill_chunk_size=32)
    results = run(busy, {
        "greedy": (prompts[0], GREEDY),
        "top_p": (prompts[9], sampled(seed=3, top_p=0.8)),
        "long": (prompts[12], sampled(seed=9, top_k=5, max_tokens=4)),
        "target": (target, sampled(seed=7)),
        "same_prompt_other_seed": (target, sampled(seed=8)),
    })
    assert len(alone) == 16
    assert results["target"].tokens == alone


def test_different_seed_gives_different_tokens(make_engine, prompts):
    engine = make_engine()
    first = engine.generate([prompts[4]], sampled(seed=7))[0]
    second = engine.generate([prompts[4]], sampled(seed=8))[0]
    assert first != second


def test_top_k_one_sampling_equals_greedy(make_engine, prompts):
    engine = make_engine()
    chosen = prompts[2:9]
    assert engine.generate(chosen, sampled(seed=5, top_k=1)) == engine.generate(chosen, GREEDY)


def test_stop_string_across_token_boundaries_stops_at_the_token_that_completes_it(make_engine, prompts,
                                                                                  tokenizer):
    engine = make_engine()
    prompt = prompts[4]
    greedy = engine.generate([prompt], GREEDY)[0]
    text = tokenizer.decode(greedy, skip_special_tokens=True)
    ends = [len(tokenizer.decode(greedy[: i + 1], skip_special_tokens=True)) for i in range(len(greedy))]
    starts = [0, *ends[:-1]]
    # A stop string from the second character of token i to the first character
    # of token i + 2: it starts inside one token and completes inside a later one.
    for i in range(len(greedy) - 2):
        last = i + 2
        if ends[i] - starts[i] >= 2 and ends[last] - starts[last] >= 2:
            stop = text[starts[i] + 1 : starts[last] + 1]
            if text.find(stop) == starts[i] + 1:
                break
    else:
        raise AssertionError(f"no usable stop string in {text!r}")
    assert starts[i] < text.find(stop) < ends[i] and starts[last] < text.find(stop) + len(stop) < ends[last]

    params = SamplingParams(temperature=0, max_tokens=16, stop=[stop])
    result = run(engine, {"stop": (prompt, params)})["stop"]
    final = result.outputs[-1]
    assert final.finished and final.finish_reason == FinishReason.STOP
    assert final.stop_reason == stop
    assert result.tokens == greedy[: last + 1]


def test_logprobs_are_one_non_positive_float_per_generated_token(make_engine, prompts):
    results = run(make_engine(), {
        "greedy": (prompts[4], SamplingParams(temperature=0, max_tokens=16, logprobs=True)),
        "sampled": (prompts[6], sampled(seed=3, top_p=0.9, logprobs=True)),
        "without": (prompts[5], sampled(seed=4)),
    })
    for name in ("greedy", "sampled"):
        result = results[name]
        assert len(result.logprobs) == len(result.tokens) == 16
        assert all(isinstance(lp, float) and lp <= 0.0 for lp in result.logprobs)
        assert all(len(out.new_logprobs) == len(out.new_token_ids) for out in result.outputs)
    assert all(out.new_logprobs is None for out in results["without"].outputs)


def test_greedy_logprobs_equal_the_reference_models_largest_log_softmax(make_engine, prompts, references):
    prompt = prompts[4]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=True)
    result = run(make_engine(), {"r": (prompt, params)})["r"]
    with torch.no_grad():
        logits = references["llama"].model(torch.tensor([prompt + result.tokens])).logits[0]
    # Position p's logits choose token p + 1: the outputs come from the last prompt position on.
    expected = logits[len(prompt) - 1 : -1].log_softmax(dim=-1).max(dim=-1).values.tolist()
    assert len(result.logprobs) == len(expected) == 16
    for got, want in zip(result.logprobs, expected, strict=True):
        assert math.isclose(got, want, abs_tol=1e-4)
