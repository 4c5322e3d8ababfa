"""What every backend shares: layout checks, coalesced copies, the export table and its source base.

A pull names blocks one by one, but a prompt's blocks were mostly allocated
together, so the ids come in runs. Copying run by run turns a 128-block pull
into a handful of strided copies (one per run, each across every layer and
K/V at once) instead of 128 * layers small ones, and needs no temporary.
"""

import threading
import time
from dataclasses import dataclass

import torch

from pdrt.errors import TransferError
from pdrt.transport.base import KVSource
from pdrt.wire import KVSourceDescriptor

Run = tuple[int, int, int]  # (first source block, first destination block, number of blocks)


def dtype_name(dtype: torch.dtype) -> str:
    """The descriptor's spelling of a dtype: "float32", "bfloat16", ..."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The dtype a descriptor names, or TransferError."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TransferError(f"unknown dtype {name!r}")
    return dtype


def describe(backend: int, address: str, pool: torch.Tensor) -> KVSourceDescriptor:
    """The descriptor of a pool tensor `[layers, 2, blocks, block_size, kv_heads, head_dim]`."""
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = pool.shape
    return KVSourceDescriptor(backend, address, num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                              dtype_name(pool.dtype))


def check_pool_shape(shape: tuple[int, ...]) -> None:
    if len(shape) != 6 or shape[1] != 2 or any(n < 1 for n in shape):
        raise TransferError(f"a KV pool is [layers, 2, blocks, block_size, kv_heads, head_dim], got {shape}")


def block_bytes(descriptor: KVSourceDescriptor, num_blocks: int) -> int:
    """Bytes of `num_blocks` blocks of every layer, K and V, in the descriptor's layout."""
    elem = torch.empty((), dtype=torch_dtype(descriptor.dtype)).element_size()
    per_block = 2 * descriptor.num_layers * descriptor.block_size * descriptor.num_kv_heads * descriptor.head_dim
    return per_block * num_blocks * elem


def check_pull(descriptor: KVSourceDescriptor, pool: torch.Tensor, src_block_ids: list[int],
               dst_block_ids: list[int]) -> None:
    """Raise TransferError unless the source's blocks fit the local pool and every id is in range."""
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = pool.shape
    ours = (num_layers, block_size, num_kv_heads, head_dim, dtype_name(pool.dtype))
    theirs = (descriptor.num_layers, descriptor.block_size, descriptor.num_kv_heads, descriptor.head_dim,
              descriptor.dtype)
    if ours != theirs:
        raise TransferError(f"source layout (layers, block_size, kv_heads, head_dim, dtype) {theirs} "
                            f"differs from the local pool's {ours}")
    if len(src_block_ids) != len(dst_block_ids):
        raise TransferError(f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} destination blocks")
    if any(not 0 <= b < descriptor.num_blocks for b in src_block_ids):
        raise TransferError(f"source block ids must be in [0, {descriptor.num_blocks})")
    if any(not 0 <= b < num_blocks for b in dst_block_ids):
        raise TransferError(f"destination block ids must be in [0, {num_blocks})")
    if len(set(dst_block_ids)) != len(dst_block_ids):
        raise TransferError("destination block ids repeat")


def coalesce(src_block_ids: list[int], dst_block_ids: list[int]) -> list[Run]:
    """Group (src, dst) pairs into runs consecutive on both sides, in the given order."""
    runs: list[Run] = []
    for s, d in zip(src_block_ids, dst_block_ids, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def copy_runs(dst: torch.Tensor, src: torch.Tensor, runs: list[Run]) -> None:
    """One strided copy per run, straight from `src`'s blocks into `dst`'s."""
    for s, d, n in runs:
        dst[:, :, d : d + n].copy_(src[:, :, s : s + n])


@dataclass(frozen=True, slots=True)
class Export:
    block_ids: frozenset[int]
    lease_expires_at: float
    puller: str  # the process id of the one decode worker that may pull it; "": any


class ExportTable:
    """Which blocks each request may have read, and until when; safe to use from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._exports: dict[str, Export] = {}

    def __len__(self) -> int:
        return len(self._exports)

    def add(self, request_id: str, block_ids: list[int], lease_expires_at: float, puller: str = "") -> None:
        with self._lock:
            self._exports[request_id] = Export(frozenset(block_ids), lease_expires_at, puller)

    def remove(self, request_id: str) -> None:
        with self._lock:
            self._exports.pop(request_id, None)

    def get(self, request_id: str) -> Export | None:
        with self._lock:
            return self._exports.get(request_id)

    def check(self, request_id: str, block_ids: list[int], puller: str | None = None) -> Export:
        """The live export covering `block_ids` for `puller` (None: whoever asks), or TransferError saying why
        there is none. Each block may be named once: a pull never asks for more than was exported."""
        export = self.get(request_id)
        if export is None or (puller is not None and export.puller and export.puller != puller):
            raise TransferError(f"request {request_id!r} has no export here for this puller (withdrawn, never "
                                "exported, or routed to another decode worker)")
        if len(set(block_ids)) != len(block_ids):
            raise TransferError("a pull names a block more than once")
        if time.monotonic() > export.lease_expires_at:
            raise TransferError(f"the lease of request {request_id!r} has expired")
        if not export.block_ids.issuperset(block_ids):
            raise TransferError(f"blocks {sorted(set(block_ids) - export.block_ids)} are not exported "
                                f"for request {request_id!r}")
        return export


class BookedSource(KVSource):
    """What the shared-memory and TCP sources share: an export table, and a descriptor once allocated."""

    kind = "KV"  # names the source in errors

    def __init__(self) -> None:
        self._exports = ExportTable()
        self._descriptor: KVSourceDescriptor | None = None

    @property
    def descriptor(self) -> KVSourceDescriptor:
        if self._descriptor is None:
            raise TransferError(f"the {self.kind} source has no pool yet; call allocate first")
        return self._descriptor

    @property
    def num_exports(self) -> int:
        return len(self._exports)

    def export(self, request_id: str, block_ids: list[int], lease_expires_at: float, puller: str = "") -> None:
        self._exports.add(request_id, block_ids, lease_expires_at, puller)

    def withdraw(self, request_id: str) -> None:
        self._exports.remove(request_id)
