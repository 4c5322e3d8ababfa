"""KV pools in device memory: which path a pull of a GPU's pool takes and what is refused (tested everywhere), and
where torch sees a CUDA device, real pulls of device pools over TCP (through pinned memory) and by the auto backend
(CUDA IPC on this host, TCP for another)."""

import subprocess
import sys
import textwrap
import time

import msgspec
import pytest
import torch

from pdrt.engine import EngineConfig, LLMEngine
from pdrt.errors import ConfigError, TransferError
from pdrt.transport import TransferBackend, make_puller, make_source
from pdrt.transport.auto import AutoPuller, local_host_id
from pdrt.transport.shm import ShmSource
from pdrt.transport.tcp import TcpPuller, TcpSource
from pdrt.wire import KVSourceDescriptor

SHAPE = (2, 2, 16, 4, 2, 8)  # layers, K/V, blocks, block_size, kv_heads, head_dim
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def lease(seconds: float = 60.0) -> float:
    return time.monotonic() + seconds


def test_a_shared_memory_pool_refuses_a_model_on_a_gpu():
    with pytest.raises(TransferError, match="host memory; the model is on cuda"):
        ShmSource("pdrt-test-never-made", device="cuda")


def test_a_same_host_source_with_an_ipc_handle_is_opened_by_cuda_ipc_not_mapped():
    source = KVSourceDescriptor(int(TransferBackend.AUTO), "/dev/shm/pdrt-test-no-such-segment", *SHAPE[:1],
                                *SHAPE[2:], "float32", host_id=local_host_id(), tcp_address="tcp://127.0.0.1:9",
                                ipc_handle=b"not a handle")
    puller = AutoPuller(torch.zeros(SHAPE))
    with pytest.raises(TransferError, match="cannot open the CUDA IPC handle"):
        puller.pull(source, "r", [0], [0], lease(), 1.0)
    puller.close()


def test_the_engine_refuses_a_transfer_pool_on_another_device(model_dirs):
    def elsewhere(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    with pytest.raises(ConfigError, match="keeps the pool on meta"):
        LLMEngine(EngineConfig(model=str(model_dirs["llama"]), num_blocks=8, speculate="off"), kv_allocator=elsewhere)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(("source_device", "puller_device"), [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")])
def test_tcp_pulls_between_device_and_host_pools_are_exact(source_device, puller_device):
    source = TcpSource("gpu-test-tcp", device=source_device)
    pool = source.allocate(SHAPE, torch.bfloat16)
    pool.copy_(torch.randn(SHAPE, device=source_device).to(torch.bfloat16))
    source.export("r", [3, 4, 5, 9], lease())
    dst = torch.zeros(SHAPE, dtype=torch.bfloat16, device=puller_device)
    puller = TcpPuller(dst)
    try:
        puller.pull(source.descriptor, "r", [3, 4, 5, 9], [0, 1, 7, 8], lease(), 10.0)
        assert torch.equal(dst[:, :, [0, 1, 7, 8]].cpu(), pool[:, :, [3, 4, 5, 9]].cpu())
        assert not dst[:, :, 2:7].any()
    finally:
        puller.close()
        source.close()


SOURCE_PROCESS = textwrap.dedent(f"""
    import sys, msgspec, torch
    from pdrt.transport import TransferBackend, make_source
    source = make_source(TransferBackend.AUTO, "gpu-test-auto", "127.0.0.1", device="cuda")
    pool = source.allocate({SHAPE}, torch.float32)
    pool.copy_(torch.arange(pool.numel(), dtype=torch.float32, device="cuda").view(pool.shape))
    torch.cuda.synchronize()
    source.export("r", [1, 2, 3], 1e12)
    print(msgspec.msgpack.encode(source.descriptor).hex(), flush=True)
    sys.stdin.read()
    source.close()
""")


@pytest.mark.gpu
@cuda
def test_a_gpu_pool_is_opened_by_ipc_on_its_host_and_pulled_over_tcp_from_another():
    child = subprocess.Popen([sys.executable, "-c", SOURCE_PROCESS], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        descriptor = msgspec.msgpack.decode(bytes.fromhex(child.stdout.readline().decode().strip()),
                                            type=KVSourceDescriptor)
        assert descriptor.ipc_handle and descriptor.tcp_address
        expected = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).view(SHAPE)[:, :, 1:4]
        for host_id in (None, "another-host"):
            pool = torch.zeros(SHAPE, device="cuda")
            puller = make_puller(pool) if host_id is None else AutoPuller(pool, host_id=host_id)
            puller.pull(descriptor, "r", [1, 2, 3], [5, 6, 7], lease(), 10.0)
            assert torch.equal(pool[:, :, 5:8].cpu(), expected)
            puller.close()
    finally:
        child.stdin.close()
        child.wait(timeout=30)


@pytest.mark.gpu
@cuda
def test_an_engine_on_a_gpu_takes_its_pool_from_the_auto_source(model_dirs):
    source = make_source(TransferBackend.AUTO, "gpu-test-engine", "127.0.0.1", device="cuda")
    try:
        engine = LLMEngine(EngineConfig(model=str(model_dirs["llama"]), device="cuda", num_blocks=64,
                                        speculate="off"), kv_allocator=source.allocate)
        assert engine.pool.tensor.is_cuda and source.descriptor.ipc_handle and source.descriptor.tcp_address
    finally:
        source.close()
