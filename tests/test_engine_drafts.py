"""Drafts in the engine: prompts prefilled while typed, rolled back on edits, behind submitted requests."""

import random

from pdrt.engine import SamplingParams
from pdrt.typeahead.draft_tokenizer import common_prefix_len
from tests.conftest import MAX_NEW_TOKENS

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS)


def step(engine, results: dict[str, list[int]]) -> None:
    for out in engine.step():
        results.setdefault(out.request_id, []).extend(out.new_token_ids)


def run_to_end(engine, results: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    results = {} if results is None else results
    while engine.has_unfinished():
        step(engine, results)
    return results


def type_and_submit(engine, request_id: str, prompt: list[int], rng: random.Random,
                    results: dict[str, list[int]]) -> None:
    """Reveal `prompt` in random pieces with random edits (wrong tokens later taken back), stepping in between."""
    shown: list[int] = []
    engine_has: list[int] = []
    position = 0
    while position < len(prompt):
        position = min(len(prompt), position + rng.randint(1, 90))
        shown = list(prompt[:position])
        if rng.random() < 0.3 and position > 20:  # a typo in the tail, to be fixed by the next piece
            shown[-rng.randint(1, 20):] = [rng.randrange(10, 1000) for _ in range(rng.randint(1, 20))]
            position = common_prefix_len(shown, prompt)
        if position == len(prompt):
            break
        if not engine_has:
            engine.add_draft(request_id, shown, colocated=True)
        else:
            kept = common_prefix_len(engine_has, shown)
            engine.update_draft(request_id, kept, shown[kept:])
        engine_has = shown
        for _ in range(rng.randint(0, 3)):
            step(engine, results)
    if not engine_has:
        engine.add_draft(request_id, prompt[:1], colocated=True)
        engine_has = prompt[:1]
    kept = common_prefix_len(engine_has, prompt)
    engine.submit_draft(request_id, kept, prompt[kept:], GREEDY)


def test_a_typed_prompt_with_edits_gives_the_output_of_the_same_prompt_sent_at_once(make_engine, references,
                                                                                     prompts):
    rng = random.Random(0)
    engine = make_engine(min_draft_chunk=32, max_prefill_chunk_size=64)
    results: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        type_and_submit(engine, f"d{i}", prompt, rng, results)
    run_to_end(engine, results)
    for i, prompt in enumerate(prompts):
        assert results[f"d{i}"] == references["llama"].greedy(prompt), f"prompt of {len(prompt)} tokens"
    assert engine.num_draft_rollbacks > 0 and engine.num_draft_tokens_ahead > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_rollback_frees_the_dropped_blocks_and_the_prefix_cache_gives_back_the_kept_full_blocks(make_engine,
                                                                                                   prompts):
    engine = make_engine(min_draft_chunk=16, max_prefill_chunk_size=512)
    prompt = prompts[-1][:300]
    engine.add_draft("d", prompt)
    while engine.has_unfinished():
        engine.step()
    seq = engine.sequences["d"]
    assert seq.num_computed_tokens == 299  # the last token waits for more text or the submit
    before = list(seq.block_table)
    free_before = engine.block_manager.num_free_blocks
    engine.update_draft("d", 200, [5, 6, 7])
    assert seq.block_table == [] and engine.block_manager.num_free_blocks == free_before + len(before)
    engine.step()
    assert seq.num_cached_tokens == 192  # 12 full blocks of the 200 kept tokens come back from the cache
    assert seq.block_table[:12] == before[:12]
    assert seq.num_computed_tokens == 192  # the 10 tokens after them wait for a step of min_draft_step
    engine.update_draft("d", 203, list(range(10, 30)))
    engine.step()
    assert seq.num_computed_tokens == 222
    engine.update_draft("d", 223, [40, 41, 42])
    assert not engine.has_unfinished()  # two tokens wait for more text ...
    engine.draft_idle("d")
    engine.step()
    assert seq.num_computed_tokens == 225  # ... unless the typist pauses


def test_drafts_wait_while_a_submitted_prompt_prefills_and_then_use_the_idle_steps(make_engine, prompts):
    engine = make_engine(min_draft_chunk=16, max_prefill_chunk_size=256, max_num_batched_tokens=600)
    engine.add_draft("draft", prompts[-1][:900])
    engine.add_request("real", prompts[-2][:500], GREEDY)
    engine.step()
    engine.step()
    assert engine.sequences["real"].num_computed_tokens == 500
    assert engine.sequences["draft"].num_computed_tokens == 0  # no step of the prompt's carried draft work
    engine.step()  # the request decodes now: the draft may ride along
    assert engine.sequences["draft"].num_computed_tokens == 256


def test_draft_caps_bound_the_kv_a_draft_and_all_drafts_may_take(make_engine, prompts):
    engine = make_engine(min_draft_chunk=16, max_draft_tokens=64, max_draft_pool_fraction=10 / 512)
    engine.add_draft("a", prompts[-1][:400])
    engine.add_draft("b", prompts[-2][:400])
    run_to_end(engine)
    a, b = engine.sequences["a"], engine.sequences["b"]
    assert a.num_computed_tokens == 64  # the per-draft cap
    assert b.num_computed_tokens <= (10 - 4) * 16  # the global cap of 10 blocks, 4 taken by "a"
    engine.submit_draft("a", 400, [], GREEDY)
    assert run_to_end(engine)["a"]  # a submitted draft is a request: no cap


def test_a_submitted_prompt_is_admitted_at_once_when_drafts_fill_the_pool(make_engine, prompts, references):
    """Drafts are best effort: they grow only into free blocks and give theirs up to a submitted prompt, so that
    a flood of them never holds a request back (or preempts itself round and round)."""
    engine = make_engine(num_blocks=40, min_draft_chunk=16, max_draft_pool_fraction=1.0)
    for i in range(12):  # 12 drafts of 100 tokens want 84 blocks of the 40
        engine.add_draft(f"d{i}", prompts[-1 - i % 6][i:i + 100])
        engine.draft_idle(f"d{i}")
    for _ in range(20):
        engine.step()
    assert engine.block_manager.num_free_blocks < 7  # the drafts hold the pool
    engine.add_request("real", prompts[9], GREEDY)  # 100 tokens
    results: dict[str, list[int]] = {}
    for _ in range(3):
        step(engine, results)
    assert results.get("real"), "the request waits behind drafts"
    assert run_to_end(engine, results)["real"] == references["llama"].greedy(prompts[9])
    queued = [seq.request_id for seq in (*engine.scheduler.waiting, *engine.scheduler.running)]
    assert sorted(queued) == sorted(f"d{i}" for i in range(12))  # every draft is still there, once


def test_a_submitted_prompt_takes_the_place_of_a_draft_when_drafts_fill_every_sequence_slot(make_engine, prompts,
                                                                                            references):
    engine = make_engine(max_num_seqs=4, min_draft_chunk=16)
    for i in range(6):  # typed, prefilled, then the typists went quiet: each draft holds a slot
        engine.add_draft(f"d{i}", prompts[10 + i % 4][i:i + 40])
        engine.draft_idle(f"d{i}")
    for _ in range(20):
        engine.step()
    scheduler = engine.scheduler
    assert len(scheduler.running) == 4 and not any(scheduler.num_pending_tokens(s) for s in scheduler.running)
    engine.add_request("real", prompts[9], GREEDY)
    results: dict[str, list[int]] = {}
    for _ in range(50):  # bounded: before, no step ever took it
        step(engine, results)
    assert results.get("real") == references["llama"].greedy(prompts[9])
