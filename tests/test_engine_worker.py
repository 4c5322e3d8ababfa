"""A worker survives whatever reaches it between two engine steps (an abort of a request its step just finished,
an op that raises something no one planned for) and a step that raises for one request."""

import asyncio

import msgspec
import zmq
import zmq.asyncio

from pdrt.engine.sampling_params import SamplingParams
from pdrt.node_config import NodeConfig
from pdrt.roles.colocated_worker import ColocatedWorker
from pdrt.testing.node import free_port
from pdrt.wire import Abort, PrefillRequest, RequestFailed, internal_decoder


async def exercise(model: str, prompt: list[int]) -> tuple[list, list]:
    config = NodeConfig.from_json(msgspec.json.encode({"model": model, "engine": {"kv_cache_bytes": 16 << 20}}))
    ctx = zmq.asyncio.Context()
    gateway = zmq.Context.shadow(ctx.underlying).socket(zmq.ROUTER)
    gateway.setsockopt(zmq.RCVTIMEO, 5000)
    address = f"tcp://127.0.0.1:{free_port()}"
    gateway.bind(address)
    worker = ColocatedWorker(config, "colocated-0", "test", ctx)
    try:
        await worker.on_receive(PrefillRequest("last", prompt, SamplingParams(temperature=0.0, max_tokens=1),
                                               address))
        worker._apply_ops()
        outputs = worker.engine.step()  # its only token: the request ends in this step
        await worker.on_receive(Abort("last"))  # the gateway's cancel arrives while the step runs
        worker.emit(outputs)
        worker.queue_op("boom", lambda: [][1])  # a bug in an op: it fails its request, not the worker
        worker.reply_to["boom"] = address
        worker._apply_ops()
        await asyncio.sleep(0.2)
        failures = []
        while gateway.poll(200):
            failures.append(internal_decoder.decode(gateway.recv_multipart()[1]))
        return outputs, failures
    finally:
        worker.inbox.close()
        worker.shut_down()
        gateway.close()
        ctx.destroy(linger=0)


def test_an_abort_of_a_request_its_last_step_just_finished_and_a_failing_op_leave_the_worker_serving(model_dirs,
                                                                                                     prompts):
    outputs, failures = asyncio.run(exercise(str(model_dirs["llama"]), prompts[5]))
    assert [o.finished for o in outputs] == [True]
    assert [(f.request_id, f.code) for f in failures if isinstance(f, RequestFailed)] == [("boom", "internal")]


async def serve_with_a_poisoned_request(model: str, prompts: list[list[int]]) -> tuple[dict, list, bool]:
    config = NodeConfig.from_json(msgspec.json.encode({"model": model, "engine": {"kv_cache_bytes": 16 << 20}}))
    ctx = zmq.asyncio.Context()
    gateway = ctx.socket(zmq.ROUTER)
    address = f"tcp://127.0.0.1:{free_port()}"
    gateway.bind(address)
    worker = ColocatedWorker(config, "colocated-0", "test", ctx)
    run = worker.engine.runner.run

    def run_or_raise(batch):  # a fault no real input reaches: the model raises whenever "poison" is in a step
        if any(seq.request_id == "poison" for seq in batch.sequences()):
            raise RuntimeError("injected")
        return run(batch)

    worker.engine.runner.run = run_or_raise
    stop = asyncio.Event()
    serving = asyncio.create_task(worker.serve(stop))
    finished: dict[str, bool] = {}
    failures = []
    try:
        for rid, prompt in [("a", prompts[3]), ("poison", prompts[4]), ("b", prompts[5])]:
            await worker.on_receive(PrefillRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=8),
                                                   address))
        async with asyncio.timeout(60):
            while len(finished) + len(failures) < 3:
                message = internal_decoder.decode((await gateway.recv_multipart())[1])
                if isinstance(message, RequestFailed):
                    failures.append(message)
                else:
                    finished.update((out.request_id, True) for out in message.outputs if out.finished)
        return finished, failures, not serving.done()
    finally:
        stop.set()
        await serving
        gateway.close()
        ctx.destroy(linger=0)


def test_a_step_that_raises_for_one_request_fails_it_retryably_and_the_worker_serves_the_rest(model_dirs, prompts):
    finished, failures, serving = asyncio.run(serve_with_a_poisoned_request(str(model_dirs["llama"]), prompts))
    assert finished == {"a": True, "b": True} and serving
    assert [(f.request_id, f.code, f.retryable) for f in failures] == [("poison", "step_failed", True)]
