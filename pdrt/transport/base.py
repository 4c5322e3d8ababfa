"""The KV transfer interface: a prefill worker exposes its pool, a decode worker pulls blocks from it.

Life cycle of one handoff:

1. the prefill worker's `KVSource` owns the storage of its KV pool
   (`allocate`, called once by the engine) and publishes a
   `KVSourceDescriptor` saying how to reach it;
2. when a prompt's KV is complete, the worker `export`s its blocks under the
   request id until a lease deadline, and sends the descriptor, block ids and
   deadline to the decode worker;
3. the decode worker's `KVPuller` copies those blocks into its own pool
   (`pull`, blocking, on a transfer thread) and then acknowledges;
4. on the acknowledgement or at the deadline the prefill worker `withdraw`s
   the export and frees the blocks.

A pull either copies every block it was asked for or raises
`TransferError`; it never leaves a silently partial copy behind as success.
"""

import abc
import enum

import torch

from pdrt.wire import KVSourceDescriptor


class TransferBackend(enum.IntEnum):
    SHM = 1  # same host: the prefill pool lives in shared memory, decode maps it
    TCP = 2  # any host: blocks travel as zero-copy ZeroMQ frames
    AUTO = 3  # both: a pool shared on its host (shared memory; CUDA IPC on a GPU), also served over TCP
    CUDA_IPC = 4  # same host, GPUs: the prefill pool is one device allocation, decode opens its IPC handle


class KVSource(abc.ABC):
    """The prefill side: owns the pool storage and makes exported blocks readable."""

    @abc.abstractmethod
    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Create the pool tensor `[layers, 2, blocks, block_size, kv_heads, head_dim]`; called once."""

    @property
    @abc.abstractmethod
    def descriptor(self) -> KVSourceDescriptor:
        """How a decode worker reaches this pool; valid after `allocate`."""

    @abc.abstractmethod
    def export(self, request_id: str, block_ids: list[int], lease_expires_at: float, puller: str = "") -> None:
        """Make `block_ids` readable for `request_id` until `withdraw` or `lease_expires_at` (time.monotonic).

        `puller` names the decode worker (its process id) the request was routed to: where the backend serves
        pulls itself (TCP) it serves this export to that worker alone; "" serves any puller."""

    @abc.abstractmethod
    def withdraw(self, request_id: str) -> None:
        """End an export; later pulls of it fail. Unknown ids are ignored."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the storage and any endpoint; the pool tensor must not be used afterwards."""


class KVPuller(abc.ABC):
    """The decode side: copies exported blocks into this worker's pool."""

    @abc.abstractmethod
    def pull(self, source: KVSourceDescriptor, request_id: str, src_block_ids: list[int],
             dst_block_ids: list[int], lease_expires_at: float, timeout_s: float) -> None:
        """Copy `src_block_ids` of `source` into `dst_block_ids` of the local pool, or raise TransferError."""

    @abc.abstractmethod
    def close(self) -> None:
        """Unmap segments and close sockets."""
