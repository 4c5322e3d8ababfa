"""A decode worker in this process, on real sockets: handoffs it cannot complete end in retryable errors, never in
output."""

import asyncio
import time

import zmq
import zmq.asyncio

from pdrt.engine.sampling_params import SamplingParams
from pdrt.node_config import ControllerConfig, NodeConfig
from pdrt.roles.split_worker import SplitWorker
from pdrt.testing.node import free_port
from pdrt.transport import TransferBackend
from pdrt.wire import KVAck, KVHandoff, KVSourceDescriptor, RequestFailed, encode, internal_decoder


def handoff(request_id: str, gateway: str, prefill: str, source: KVSourceDescriptor, num_prompt: int,
            lease_s: float = 30.0) -> KVHandoff:
    num_blocks = -(-num_prompt // 16)
    return KVHandoff(request_id, list(range(10, 10 + num_prompt)), 42, SamplingParams(temperature=0, max_tokens=4),
                     gateway, prefill, source, list(range(num_blocks)), time.monotonic() + lease_s)


async def exercise(model: str) -> tuple[list[object], list[object], int]:
    config = NodeConfig(model=model, controller=ControllerConfig(port=free_port()))
    ctx = zmq.asyncio.Context()
    gateway = ctx.socket(zmq.ROUTER)
    gateway.bind("tcp://127.0.0.1:*")
    prefill = ctx.socket(zmq.ROUTER)
    prefill.bind("tcp://127.0.0.1:*")
    gateway_address = gateway.getsockopt_string(zmq.LAST_ENDPOINT)
    prefill_address = prefill.getsockopt_string(zmq.LAST_ENDPOINT)
    worker = SplitWorker(config, "decode-0", "test", ctx, "decode-test", "decode")
    stop = asyncio.Event()
    serving = asyncio.create_task(worker.serve(stop))
    layout = worker.engine.pool.layout
    missing = KVSourceDescriptor(int(TransferBackend.SHM), "/dev/shm/pdrt-test-no-such-segment", layout.num_layers,
                                 64, layout.block_size, layout.num_kv_heads, layout.head_dim, "float32")
    unreachable = KVSourceDescriptor(int(TransferBackend.TCP), f"tcp://127.0.0.1:{free_port()}",
                                     layout.num_layers, 64, layout.block_size, layout.num_kv_heads, layout.head_dim,
                                     "float32")
    sender = ctx.socket(zmq.DEALER)
    sender.setsockopt(zmq.IDENTITY, b"prefill-0")  # an inbox takes a handoff from a prefill worker alone
    sender.connect(worker.inbox.address)
    await sender.send(encode(handoff("shm", gateway_address, prefill_address, missing, 40)))
    await sender.send(encode(handoff("tcp", gateway_address, prefill_address, unreachable, 40)))

    async def collect(sock: zmq.asyncio.Socket, n: int) -> list[object]:
        return [internal_decoder.decode((await sock.recv_multipart())[1]) for _ in range(n)]

    try:
        failures = await asyncio.wait_for(collect(gateway, 2), 60)
        acks = await asyncio.wait_for(collect(prefill, 2), 5)
        await asyncio.sleep(0.1)
        used = worker.engine.block_manager.num_blocks - worker.engine.block_manager.num_free_blocks
    finally:
        stop.set()
        await serving
        sender.close()
        gateway.close()
        prefill.close()
        ctx.term()
    return failures, acks, used


def test_a_handoff_whose_kv_cannot_be_pulled_fails_the_request_acks_the_prefill_and_frees_the_blocks(model_dirs,
                                                                                                    monkeypatch):
    monkeypatch.setattr("pdrt.roles.kv_imports.PULL_TIMEOUT_S", 0.5)
    failures, acks, used = asyncio.run(exercise(str(model_dirs["llama"])))
    assert sorted(f.request_id for f in failures) == ["shm", "tcp"]
    # Retryable: the KV that did not arrive is no fault of the request, which the gateway then moves elsewhere.
    assert all(isinstance(f, RequestFailed) and f.code == "transfer_failed" and f.retryable for f in failures)
    assert sorted(a.request_id for a in acks) == ["shm", "tcp"] and all(isinstance(a, KVAck) for a in acks)
    assert used == 0
