"""KV transfer between GPUs of one host: the prefill pool is one device allocation, opened by each decode worker
through a CUDA IPC handle, and a pull is device-to-device copies on a stream of the puller's own.

The source allocates the pool as a single CUDA tensor and publishes its IPC
handle in the descriptor (`ipc_handle`), which travels with every handoff;
a puller opens it once per source incarnation (the segment name in
`address` is unique to one) and keeps it open, at most MAX_OPEN of them.
A pull then copies the requested runs of blocks with asynchronous copies
on the puller's own CUDA stream, so that they run on the copy engines
beside the worker's decode steps instead of after them, waits for them,
and checks the lease as the shared-memory backend does: a copy that ended
after the deadline may have read blocks the prefill worker had reused, and
fails. Nothing on the source side takes part in a pull.

The handle is torch's own CUDA tensor sharing (the `_share_cuda_` of
torch.multiprocessing) rather than cuda-python's `cudaIpcGetMemHandle`:
both hand over the same CUDA IPC memory handle, but torch's also carries
the offset of the pool inside the caching allocator's block and rebuilds a
tensor of the right size and dtype on the other side, where raw handles
would need the allocation's base address looked up and the pointer wrapped
by hand. Its fields travel as a msgspec struct, never pickled.

`IpcSharing` is the one seam: exporting a tensor's handle, opening one, and
the stream copy. `TorchIpc` is the CUDA one; tests without a GPU run the
handshake and lease logic through a host-memory stand-in.
"""

import threading
import time
from collections import OrderedDict
from typing import Protocol

import msgspec
import torch

from pdrt.actors.cluster_key import ClusterKey
from pdrt.errors import TransferError
from pdrt.transport.auto import local_host_id
from pdrt.transport.base import KVPuller, TransferBackend
from pdrt.transport.copy import BookedSource, Run, check_pool_shape, check_pull, coalesce, describe
from pdrt.transport.device_copy import wait
from pdrt.wire import KVSourceDescriptor

MAX_OPEN = 8  # source pools a puller keeps open: a node's prefill workers, and a few restarted ones


class CudaHandle(msgspec.Struct, array_like=True, frozen=True):
    """What `torch.multiprocessing.reductions.rebuild_cuda_tensor` needs to open a shared CUDA tensor."""

    size: list[int]
    stride: list[int]
    offset: int
    dtype: str
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class IpcSharing(Protocol):
    def export(self, pool: torch.Tensor) -> bytes: ...

    def open(self, handle: bytes, pool: torch.Tensor) -> torch.Tensor: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, runs: list[Run], timeout_s: float) -> None: ...


class TorchIpc:
    """CUDA IPC through torch's tensor sharing; copies on one stream of the puller's, then waited for (a stuck
    device ends the process: device_copy.wait)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def export(self, pool: torch.Tensor) -> bytes:
        storage = pool._typed_storage()
        (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
         event_sync) = storage._share_cuda_()
        return msgspec.msgpack.encode(CudaHandle(list(pool.size()), list(pool.stride()), pool.storage_offset(),
                                                 str(pool.dtype).removeprefix("torch."), device, handle, size_bytes,
                                                 offset_bytes, ref_handle, ref_offset, event_handle or b"",
                                                 bool(event_sync)))

    def open(self, handle: bytes, pool: torch.Tensor) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        h = msgspec.msgpack.decode(handle, type=CudaHandle)
        return rebuild_cuda_tensor(torch.Tensor, torch.Size(h.size), tuple(h.stride), h.offset,
                                   torch.storage.TypedStorage, getattr(torch, h.dtype), h.device, h.handle,
                                   h.storage_size_bytes, h.storage_offset_bytes, False, h.ref_counter_handle,
                                   h.ref_counter_offset, h.event_handle or None, h.event_sync_required)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, runs: list[Run], timeout_s: float) -> None:
        stream = self._streams.get(dst.device)
        if stream is None:
            stream = self._streams[dst.device] = torch.cuda.Stream(device=dst.device)
        with torch.cuda.stream(stream):
            for s, d, n in runs:
                dst[:, :, d : d + n].copy_(src[:, :, s : s + n], non_blocking=True)
        wait(stream, timeout_s, "CUDA IPC pull")


class CudaIpcSource(BookedSource):
    """A prefill pool in one CUDA allocation; `host` and `key` are not needed: only this host's processes of
    this user can open its handle."""

    kind = "CUDA IPC"

    def __init__(self, name: str, host: str = "", key: ClusterKey | None = None,
                 sharing: IpcSharing | None = None, device: str = "cuda") -> None:
        super().__init__()
        self.name = name
        self.sharing = sharing or TorchIpc()
        self.device = device
        self._pool: torch.Tensor | None = None

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self._pool is not None:
            raise TransferError(f"the CUDA IPC source {self.name} is already allocated")
        check_pool_shape(tuple(shape))
        self._pool = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        descriptor = describe(TransferBackend.CUDA_IPC, self.name, self._pool)
        self._descriptor = msgspec.structs.replace(descriptor, host_id=local_host_id(),
                                                   ipc_handle=self.sharing.export(self._pool))
        return self._pool

    def close(self) -> None:
        self._pool = None


class CudaIpcPuller(KVPuller):
    """Opens each source pool once and copies blocks out of it device to device; safe from several threads."""

    def __init__(self, pool: torch.Tensor, identity: str = "", key: ClusterKey | None = None,
                 sharing: IpcSharing | None = None) -> None:
        self.pool = pool
        self.sharing = sharing or TorchIpc()
        self._open: OrderedDict[str, torch.Tensor] = OrderedDict()  # source name -> its pool, least recent first
        self._lock = threading.Lock()
        self.num_opened = 0

    def pull(self, source: KVSourceDescriptor, request_id: str, src_block_ids: list[int],
             dst_block_ids: list[int], lease_expires_at: float, timeout_s: float) -> None:
        check_pull(source, self.pool, src_block_ids, dst_block_ids)
        if not source.ipc_handle or source.host_id != local_host_id():
            raise TransferError(f"the CUDA IPC source {source.address!r} is not on this host")
        if time.monotonic() > lease_expires_at:
            raise TransferError(f"the lease of request {request_id!r} expired before the pull began")
        src = self._source_pool(source)
        self.sharing.copy(self.pool, src, coalesce(src_block_ids, dst_block_ids), timeout_s)
        if time.monotonic() > lease_expires_at:
            raise TransferError(f"the lease of request {request_id!r} expired during the pull; "
                                "the copied blocks may have been reused")

    def _source_pool(self, source: KVSourceDescriptor) -> torch.Tensor:
        with self._lock:
            pool = self._open.get(source.address)
            if pool is None:
                try:
                    pool = self.sharing.open(source.ipc_handle, self.pool)
                except (RuntimeError, ValueError, msgspec.DecodeError) as exc:
                    raise TransferError(f"cannot open the CUDA IPC handle of {source.address!r}: {exc}") from exc
                if tuple(pool.shape) != (source.num_layers, 2, source.num_blocks, source.block_size,
                                         source.num_kv_heads, source.head_dim):
                    raise TransferError(f"the CUDA IPC pool of {source.address!r} is {tuple(pool.shape)}, "
                                        "not what its descriptor says")
                self._open[source.address] = pool
                self.num_opened += 1
                while len(self._open) > MAX_OPEN:
                    self._open.popitem(last=False)
            self._open.move_to_end(source.address)
            return pool

    def close(self) -> None:
        with self._lock:
            self._open.clear()

