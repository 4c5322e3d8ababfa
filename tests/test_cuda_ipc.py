"""The CUDA IPC transfer backend: its handshake (a source pool opened once per incarnation), lease and checks,
through a host-memory stand-in for the CUDA calls where there is no GPU; and, where torch sees one, a real pull
between two processes."""

import secrets
import subprocess
import sys
import time

import msgspec
import pytest
import torch

from pdrt.errors import TransferError
from pdrt.transport import TransferBackend, make_puller
from pdrt.transport.auto import local_host_id
from pdrt.transport.copy import copy_runs
from pdrt.transport.cuda_ipc import MAX_OPEN, CudaIpcPuller, CudaIpcSource
from pdrt.wire import KVSourceDescriptor

SHAPE = (2, 2, 16, 4, 2, 8)  # layers, K/V, blocks, block size, kv heads, head dim


class HostIpc:
    """Host memory standing in for CUDA IPC: a handle names a pool of this process; a copy may be slow."""

    pools: dict[bytes, torch.Tensor] = {}

    def __init__(self, copy_s: float = 0.0) -> None:
        self.copy_s = copy_s

    def export(self, pool: torch.Tensor) -> bytes:
        handle = secrets.token_bytes(16)
        HostIpc.pools[handle] = pool
        return handle

    def open(self, handle: bytes, pool: torch.Tensor) -> torch.Tensor:
        if handle not in HostIpc.pools:
            raise RuntimeError("invalid device pointer")
        return HostIpc.pools[handle]

    def copy(self, dst: torch.Tensor, src: torch.Tensor, runs, timeout_s: float) -> None:
        time.sleep(self.copy_s)
        copy_runs(dst, src, runs)


def source(name: str = "prefill-0-a") -> CudaIpcSource:
    s = CudaIpcSource(name, sharing=HostIpc(), device="cpu")
    s.allocate(SHAPE, torch.float32).copy_(torch.randn(SHAPE))
    return s


def test_a_pull_opens_the_source_pool_once_and_copies_the_blocks():
    src = source()
    d = src.descriptor
    assert (d.backend, d.host_id, len(d.ipc_handle)) == (TransferBackend.CUDA_IPC, local_host_id(), 16)
    pool = torch.zeros(SHAPE)
    puller = CudaIpcPuller(pool, sharing=HostIpc())
    far = time.monotonic() + 10
    puller.pull(d, "r1", [3, 4, 5], [0, 1, 9], far, 1.0)
    puller.pull(d, "r2", [7], [2], far, 1.0)
    assert puller.num_opened == 1
    assert torch.equal(pool[:, :, [0, 1, 9, 2]], src._pool[:, :, [3, 4, 5, 7]])
    assert not pool[:, :, 3].any()


def test_a_restarted_source_is_opened_again_and_only_the_latest_stay_open():
    pool = torch.zeros(SHAPE)
    puller = CudaIpcPuller(pool, sharing=HostIpc())
    for i in range(MAX_OPEN + 2):
        puller.pull(source(f"prefill-0-{i}").descriptor, "r", [0], [0], time.monotonic() + 10, 1.0)
    assert puller.num_opened == MAX_OPEN + 2 and len(puller._open) == MAX_OPEN


def test_a_lease_that_ends_before_or_during_the_copy_fails_the_pull():
    d = source().descriptor
    with pytest.raises(TransferError, match="expired before"):
        CudaIpcPuller(torch.zeros(SHAPE), sharing=HostIpc()).pull(d, "r", [0], [0], time.monotonic() - 1, 1.0)
    with pytest.raises(TransferError, match="expired during"):
        CudaIpcPuller(torch.zeros(SHAPE), sharing=HostIpc(copy_s=0.2)).pull(d, "r", [0], [0],
                                                                            time.monotonic() + 0.1, 1.0)


def test_another_hosts_source_a_bad_handle_or_another_layout_is_refused():
    d = source().descriptor
    puller = CudaIpcPuller(torch.zeros(SHAPE), sharing=HostIpc())
    far = time.monotonic() + 10
    with pytest.raises(TransferError, match="not on this host"):
        puller.pull(msgspec.structs.replace(d, host_id="elsewhere/x/1"), "r", [0], [0], far, 1.0)
    with pytest.raises(TransferError, match="cannot open the CUDA IPC handle"):
        puller.pull(msgspec.structs.replace(d, address="other", ipc_handle=b"forged"), "r", [0], [0], far, 1.0)
    with pytest.raises(TransferError, match="differs from the local pool"):
        CudaIpcPuller(torch.zeros(2, 2, 16, 4, 2, 4), sharing=HostIpc()).pull(d, "r", [0], [0], far, 1.0)
    with pytest.raises(TransferError, match="source block ids"):
        puller.pull(d, "r", [16], [0], far, 1.0)


def test_the_descriptor_with_its_handle_survives_the_wire():
    d = source().descriptor
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(d), type=KVSourceDescriptor) == d


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_decode_process_pulls_blocks_from_a_prefill_pool_in_another_process_on_the_gpu():
    child = subprocess.Popen([sys.executable, "-c", PRODUCER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        descriptor = msgspec.msgpack.decode(bytes.fromhex(child.stdout.readline().decode().strip()),
                                            type=KVSourceDescriptor)
        pool = torch.zeros(SHAPE, device="cuda")
        puller = make_puller(pool)
        puller.pull(descriptor, "r", [1, 2, 3], [5, 6, 7], time.monotonic() + 10, 5.0)
        expected = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).view(SHAPE)[:, :, 1:4]
        assert torch.equal(pool[:, :, 5:8].cpu(), expected)
        puller.close()
    finally:
        child.stdin.close()
        child.wait(timeout=30)


PRODUCER = f"""
import sys, msgspec, torch
from pdrt.transport import TransferBackend, make_source
src = make_source(TransferBackend.CUDA_IPC, "gpu-test-prefill", "")
pool = src.allocate({SHAPE}, torch.float32)
pool.copy_(torch.arange(pool.numel(), dtype=torch.float32).view(pool.shape))
torch.cuda.synchronize()
print(msgspec.msgpack.encode(src.descriptor).hex(), flush=True)
sys.stdin.read()  # the pool lives until the test is done with it
"""
