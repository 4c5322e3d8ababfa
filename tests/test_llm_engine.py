"""The engine against transformers' generate: batching, chunking, prefix cache, preemption, KV handoff."""

import pytest

from pdrt.engine import FinishReason, SamplingParams
from pdrt.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    KVPoolFullError,
    PromptTooLongError,
    RequestTooLargeError,
)
from tests.conftest import MAX_NEW_TOKENS

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("chunk", [37, 128])
def test_greedy_batch_equals_generate_token_for_token(make_engine, references, prompts, arch, chunk):
    engine = make_engine(arch, max_prefill_chunk_size=chunk, max_num_batched_tokens=300)
    outputs = engine.generate(prompts, GREEDY)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output == references[arch].greedy(prompt), f"prompt of {len(prompt)} tokens"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_requests_added_while_others_decode_still_match_generate(make_engine, references, prompts):
    engine = make_engine(max_prefill_chunk_size=64)
    results: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending:
            i, prompt = pending.pop()
            engine.add_request(str(i), prompt, GREEDY)
            results[str(i)] = []
        for out in engine.step():
            results[out.request_id].extend(out.new_token_ids)
    for i, prompt in enumerate(prompts):
        assert results[str(i)] == references["llama"].greedy(prompt)


def test_shared_prefix_computes_only_new_blocks_and_matches_generate(make_engine, references, prompts):
    engine = make_engine(block_size=16)
    base = prompts[-1][:300]
    engine.generate([base], GREEDY)
    second = base[:290] + prompts[-2][:40]
    before = engine.num_computed_prompt_tokens
    engine.add_request("second", second, GREEDY)
    tokens, cached = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            cached = out.num_cached_tokens
    assert cached == 288  # 18 full blocks of the 290 shared tokens
    assert engine.num_computed_prompt_tokens - before == len(second) - 288
    assert tokens == references["llama"].greedy(second)


def test_fully_cached_prompt_still_recomputes_its_last_block(make_engine, references, prompts):
    engine = make_engine(block_size=16)
    prompt = prompts[-1][:64]
    engine.generate([prompt], GREEDY)
    before = engine.num_computed_prompt_tokens
    assert engine.generate([prompt], GREEDY) == [references["llama"].greedy(prompt)]
    assert engine.num_computed_prompt_tokens - before == 16


def test_pool_too_small_for_the_batch_preempts_and_still_completes_correctly(make_engine, references, prompts):
    batch = prompts[8:14]  # 64 to 401 tokens
    engine = make_engine(num_blocks=40, block_size=16, max_prefill_chunk_size=64)
    outputs = engine.generate(batch, SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS))
    assert engine.scheduler.num_preemptions > 0
    for prompt, output in zip(batch, outputs, strict=True):
        assert output == references["llama"].greedy(prompt)
    assert engine.block_manager.num_free_blocks == 40


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=12)])
def test_a_demoted_sequence_decodes_every_other_step_and_its_tokens_do_not_change(make_engine, prompts, params):
    chosen = [prompts[9], prompts[15], prompts[12]]  # 100, 700 and 256 tokens
    expected = make_engine().generate(chosen, params)
    engine = make_engine()
    for i, prompt in enumerate(chosen):
        engine.add_request(str(i), prompt, params)
    results: dict[str, list[int]] = {str(i): [] for i in range(3)}
    while any(not tokens for tokens in results.values()):
        for out in engine.step():
            results[out.request_id].extend(out.new_token_ids)
    engine.scheduler.demote(engine.sequences["1"], 2)
    served = []
    while engine.has_unfinished():
        outputs = engine.step()
        served.append({out.request_id for out in outputs})
        for out in outputs:
            results[out.request_id].extend(out.new_token_ids)
    with_others = [ids for ids in served if ids - {"1"}]
    assert all({"0", "2"} <= ids for ids in with_others)
    assert ["1" in ids for ids in with_others] == [i % 2 == 1 for i in range(len(with_others))]
    assert all(ids == {"1"} for ids in served[len(with_others):])  # alone, it decodes every step
    assert [results[str(i)] for i in range(3)] == expected
    assert engine.scheduler.demoted == [] and engine.scheduler.num_demotions == 1


def test_demoted_sequences_in_a_pool_too_small_still_complete_correctly(make_engine, references, prompts):
    batch = prompts[8:14]
    engine = make_engine(num_blocks=40, block_size=16, max_prefill_chunk_size=64)
    for i, prompt in enumerate(batch):
        engine.add_request(str(i), prompt, GREEDY)
    results: dict[str, list[int]] = {str(i): [] for i in range(len(batch))}
    while engine.has_unfinished():
        for seq in engine.scheduler.running:
            if seq.is_decoding and seq.decode_every == 1 and len(engine.scheduler.demoted) < 2:
                engine.scheduler.demote(seq, 2)
        for out in engine.step():
            results[out.request_id].extend(out.new_token_ids)
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.num_demotions > 2
    assert [results[str(i)] for i in range(len(batch))] == [references["llama"].greedy(p) for p in batch]
    assert engine.scheduler.demoted == [] and engine.block_manager.num_free_blocks == 40


def _handoff(prefill, decode, request_id, prompt, params, split):
    """Prefill `prompt` in two pieces on one engine, move its KV, decode on the other."""
    prefill.add_draft(request_id, prompt[:split])
    while prefill.has_unfinished():
        assert prefill.step() == []
    prefill.submit_draft(request_id, split, prompt[split:], params)
    first = None
    while first is None:
        for out in prefill.step():
            first = out
    if first.finished:
        return first.new_token_ids
    reservation = decode.reserve_import(request_id, prompt, first.new_token_ids[0], params)
    todo = list(zip(first.kv_block_ids, reservation.block_ids, strict=True))[reservation.num_cached_blocks :]
    if todo:
        src, dst = zip(*todo, strict=True)
        decode.pool.write_blocks(list(dst), prefill.pool.read_blocks(list(src)))
    decode.commit_import(request_id)
    prefill.release(request_id)
    tokens = list(first.new_token_ids)
    while decode.has_unfinished():
        for out in decode.step():
            tokens.extend(out.new_token_ids)
    return tokens


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=10)])
def test_prefill_then_imported_decode_equals_colocated(make_engine, references, prompts, params):
    prefill = make_engine(max_prefill_chunk_size=50)
    decode = make_engine()
    colocated = make_engine()
    chosen = prompts[1:18:3]
    expected = colocated.generate(chosen, params)
    for i, prompt in enumerate(chosen):
        got = _handoff(prefill, decode, f"r{i}", prompt, params, split=max(1, len(prompt) // 2))
        assert got == expected[i]
        if params.is_greedy:
            assert got == references["llama"].greedy(prompt)
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks


def _first_tokens(engine, prompts):
    """Prefill-only `prompts`, queued at once: for each, the tokens computed until its first token came, and it."""
    for i, prompt in enumerate(prompts):
        engine.add_prefill(f"p{i}", prompt, GREEDY)
    came: dict[str, tuple[int, list[int]]] = {}
    computed = 0
    while len(came) < len(prompts):
        outputs = engine.step()
        batch = engine.last_batch
        computed += len(batch.decodes) + sum(n for _, n in batch.prefills)
        for out in outputs:
            came[out.request_id] = (computed, out.new_token_ids)
    return [came[f"p{i}"] for i in range(len(prompts))]


def test_prompts_one_by_one_come_out_shortest_first_and_short_ones_still_batch(make_engine, references, prompts):
    long = [prompts[-1], prompts[-3], prompts[-2]]  # 1100, 700 and 1000 tokens: chunks of 512
    side_by_side = _first_tokens(make_engine(), long)
    assert side_by_side[0][0] == 2800  # the first prompt came last: it waited for all the others
    one_by_one = _first_tokens(make_engine(prompt_batch_tokens=48), long)
    assert [computed for computed, _ in one_by_one] == [2800, 700, 1700]  # equal waits: the least work first
    assert [tokens for _, tokens in one_by_one] == [tokens for _, tokens in side_by_side]
    assert [tokens for _, tokens in one_by_one] == [references["llama"].greedy(p)[:1] for p in long]
    short = [prompts[4], prompts[5], prompts[6], prompts[-1]]  # 16, 17 and 31 tokens, then 1100
    computed = [computed for computed, _ in _first_tokens(make_engine(prompt_batch_tokens=48), short)]
    assert computed == [33, 33, 64, 1164]  # the first two share a step; the third would pass 48 tokens


def test_prompts_one_by_one_let_a_long_prompt_that_waited_go_before_a_shorter_newcomer(make_engine, prompts):
    engine = make_engine(prompt_batch_tokens=48)
    engine.add_prefill("long", prompts[-1], GREEDY)  # 1100 tokens
    engine.add_prefill("short", prompts[-3], GREEDY)  # 700: the least work, so it goes first
    engine.step()  # its first chunk of 512
    engine.add_prefill("newcomer", prompts[-2], GREEDY)  # 1000, but it has waited 188 tokens to the long one's 700
    came, computed = [], 0
    while len(came) < 3:
        outputs = engine.step()
        computed += sum(n for _, n in engine.last_batch.prefills)
        came += [(out.request_id, computed) for out in outputs]
    assert came == [("short", 188), ("long", 1288), ("newcomer", 2288)]


def test_first_token_work_foretells_the_order_and_work_of_prompts_one_by_one(make_engine, prompts):
    engine = make_engine(prompt_batch_tokens=48)
    for name, prompt in (("long", prompts[-1]), ("short", prompts[-3]), ("middle", prompts[-2])):
        engine.add_prefill(name, prompt, GREEDY)  # 1100, 700 and 1000 tokens
    assert engine.scheduler.first_token_work() == {"short": 700, "middle": 1700, "long": 2800}
    engine.step()  # the short one's first chunk of 512: it runs, and is no longer waiting
    engine.add_prefill("newcomer", prompts[-5], GREEDY)  # 401 tokens, waited for none of the 512
    # The 188 left of the short one, begun; then the middle one (its wait of 700 is the most for its work);
    # then the newcomer, whose 401 tokens have waited 1188 by then; the long one last: what the steps below do.
    foretold = engine.scheduler.first_token_work()
    assert foretold == {"short": 188, "middle": 1188, "newcomer": 1589, "long": 2689}
    assert [seq.request_id for seq in engine.scheduler.started_prompts()] == ["short"]
    came, computed = {}, 0
    while len(came) < 4:
        outputs = engine.step()
        computed += sum(n for _, n in engine.last_batch.prefills)
        came.update({out.request_id: computed for out in outputs})
    assert {rid: came[rid] for rid in foretold} == foretold


def test_prompts_one_by_one_count_only_the_work_their_cached_prefix_leaves(make_engine, references, prompts):
    engine = make_engine(prompt_batch_tokens=48)
    _first_tokens(engine, [prompts[-2]])  # 1000 tokens: once released, their full blocks stay in the prefix cache
    engine.abort("p0")
    follow_up = prompts[-2] + prompts[4]  # 1016 tokens
    got = _first_tokens(engine, [prompts[-3], follow_up])  # 700 uncached tokens queued first
    assert [computed for computed, _ in got] == [724, 24]  # the 24 tokens past 62 cached blocks went first
    assert [tokens for _, tokens in got] == [references["llama"].greedy(p)[:1] for p in (prompts[-3], follow_up)]


def test_import_reuses_prefix_blocks_the_decode_worker_already_has(make_engine, prompts):
    prefill, decode = make_engine(), make_engine()
    prompt = prompts[-1][:100]
    _handoff(prefill, decode, "a", prompt, GREEDY, split=50)
    reservation = decode.reserve_import("b", prompt[:96] + [5, 6], 7, GREEDY)
    assert reservation.num_cached_blocks == 6
    decode.abort("b")
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks


def test_import_into_a_full_pool_is_refused_and_changes_nothing(make_engine, prompts):
    decode = make_engine(num_blocks=70)
    decode.reserve_import("a", prompts[-1][:1000], 1, GREEDY)
    free = decode.block_manager.num_free_blocks
    with pytest.raises(KVPoolFullError):
        decode.reserve_import("b", prompts[-2][:200], 1, GREEDY)
    assert decode.block_manager.num_free_blocks == free
    assert "b" not in decode.sequences


def test_max_tokens_and_eos_end_requests_with_their_reasons(make_engine, prompts):
    engine = make_engine()
    engine.add_request("a", prompts[3], SamplingParams(temperature=0, max_tokens=3))
    outs = [o for _ in range(10) for o in engine.step()]
    assert sum(len(o.new_token_ids) for o in outs) == 3
    assert outs[-1].finished and outs[-1].finish_reason == FinishReason.LENGTH
    first = engine.generate([prompts[3]], SamplingParams(temperature=0, max_tokens=1))[0][0]
    engine.add_request("b", prompts[3], SamplingParams(temperature=0, stop_token_ids=[first]))
    out = engine.step()[0]
    assert out.finished and out.finish_reason == FinishReason.STOP and out.stop_reason == first


def test_abort_frees_every_block(make_engine, prompts):
    engine = make_engine()
    for i, prompt in enumerate(prompts[10:16]):
        engine.add_request(str(i), prompt, GREEDY)
    engine.step()
    for i in range(6):
        engine.abort(str(i))
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_bad_requests_fail_at_creation_with_typed_errors(make_engine, prompts):
    engine = make_engine(num_blocks=4, block_size=16, max_model_len=100)
    with pytest.raises(PromptTooLongError):
        engine.add_request("long", prompts[10], GREEDY)
    with pytest.raises(RequestTooLargeError):
        engine.add_request("big", prompts[5], SamplingParams(max_tokens=200))
    with pytest.raises(InvalidRequestError):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(InvalidRequestError):
        engine.add_request("oov", [10**6], GREEDY)
    with pytest.raises(InvalidSamplingParamsError):
        engine.add_request("bad", prompts[3], SamplingParams(temperature=-1))
    engine.add_request("ok", prompts[3], GREEDY)
    with pytest.raises(DuplicateRequestError):
        engine.add_request("ok", prompts[3], GREEDY)
    assert list(engine.sequences) == ["ok"]


def test_pool_is_sized_by_memory_budget_and_reports_its_capacity(make_engine):
    engine = make_engine(num_blocks=None, kv_cache_memory_bytes=1 << 20, block_size=16)
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 slots, 2 KV heads of 16 dims, float32
    assert engine.block_manager.num_blocks == (1 << 20) // bytes_per_block
    assert engine.capacity_tokens == engine.block_manager.num_blocks * 16
