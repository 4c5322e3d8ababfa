"""The worker profile: how each worker shares the machine, derived from the device and the model, overridden only by
`[experimental]`."""

from pathlib import Path

import msgspec

from pdrt.node_config import NodeConfig
from pdrt.worker_profile import CATCH_UP_WAIT, CPU_PROMPT_BATCH, PREFILL_NICE, SMALL_MODEL_PARAMS, worker_profile

SMALL, LARGE = SMALL_MODEL_PARAMS - 1, SMALL_MODEL_PARAMS


def config(**settings) -> NodeConfig:
    return NodeConfig.from_json(msgspec.json.encode({"model": "/m", **settings}))


def test_prefill_workers_yield_the_cpu_and_the_others_do_not():
    node = config()
    assert [worker_profile(node, role, LARGE).nice for role in ("prefill", "decode", "colocated")] == [
        PREFILL_NICE, 0, 0]
    assert worker_profile(config(experimental={"prefill_nice": 5}), "prefill", LARGE).nice == 5


def test_a_prefill_worker_that_yields_catches_up_whatever_its_model():
    node = config()
    assert worker_profile(node, "prefill", SMALL).catch_up_wait == CATCH_UP_WAIT
    assert worker_profile(node, "prefill", LARGE).catch_up_wait == CATCH_UP_WAIT
    assert worker_profile(node, "decode", SMALL).catch_up_wait is None
    assert worker_profile(config(experimental={"prefill_nice": 0}), "prefill", SMALL).catch_up_wait is None


def test_decode_workers_of_a_large_model_on_the_cpu_borrow_threads_unless_told_otherwise():
    assert worker_profile(config(), "decode", LARGE).borrow_threads
    assert not worker_profile(config(), "decode", SMALL).borrow_threads
    assert not worker_profile(config(), "prefill", LARGE).borrow_threads
    assert not worker_profile(config(engine={"device": "cuda"}), "decode", LARGE).borrow_threads
    assert worker_profile(config(experimental={"borrow_threads": True}), "decode", SMALL).borrow_threads
    assert not worker_profile(config(experimental={"borrow_threads": False}), "decode", LARGE).borrow_threads


def test_prefill_workers_on_the_cpu_alone_take_prompts_one_by_one_unless_told_otherwise(tmp_path: Path):
    node = config()
    assert node.engine_config("prefill").prompt_batch_tokens == CPU_PROMPT_BATCH
    assert worker_profile(node, "prefill", LARGE).prompt_batch_tokens == CPU_PROMPT_BATCH
    assert node.engine_config("decode").prompt_batch_tokens is None
    assert node.engine_config("colocated").prompt_batch_tokens is None
    assert config(engine={"device": "cuda"}).engine_config("prefill").prompt_batch_tokens is None
    told = config(engine={"device": "cuda"}, experimental={"prompt_batch_tokens": 256})
    assert told.engine_config("prefill").prompt_batch_tokens == 256


def test_threads_split_the_cores_evenly_unless_told():
    node = config(prefill={"count": 2})
    assert worker_profile(node, "decode", LARGE).threads == node.threads_for("decode") >= 1
    assert worker_profile(config(experimental={"decode_threads": 3}), "decode", LARGE).threads == 3
