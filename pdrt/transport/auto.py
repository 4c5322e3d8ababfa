"""KV transfer chosen per pair of hosts: the pool is shared on its own host and also served over TCP.

A prefill worker whose decode workers are on its own host and on others
cannot pick one backend for all of them: shared memory is the fast path but
reaches only its own host, TCP reaches every host but costs a gather, a send
and a receive. The auto source offers both for one pool:

1. `allocate` creates the pool in a /dev/shm segment (shm.py) and starts a
   TCP server (tcp.py) that serves the very same tensor, so prefill writes
   its KV once;
2. its descriptor carries the segment's path, the TCP endpoint, and the
   identity of the host the segment is on (`local_host_id`);
3. the puller compares that identity with its own: equal, it maps the segment
   (the shared-memory puller, which checks the lease on the shared clock);
   different, it pulls over TCP (the source checks the lease on its clock).

Exports go to both halves: the TCP server refuses what is not exported,
while the shared-memory side only keeps books (its puller checks the lease).

A pool on a GPU is one device allocation shared by its CUDA IPC handle
(cuda_ipc.py) instead of a /dev/shm segment, and served over TCP through
pinned host memory: a puller of its own host opens the handle, any other
pulls over TCP.
"""

import os
import socket
from pathlib import Path

import msgspec
import torch

from pdrt.actors.cluster_key import ClusterKey
from pdrt.errors import ConfigError, TransferError
from pdrt.transport.base import KVPuller, KVSource, TransferBackend
from pdrt.transport.shm import SHM_DIR, ShmPuller, ShmSource
from pdrt.transport.tcp import TcpPuller, TcpSource
from pdrt.wire import KVSourceDescriptor

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def local_host_id() -> str:
    """Who can map this process's segments: "hostname/boot id/device of /dev/shm", or "" when unknown.

    The boot id names one run of one kernel: two processes with the same one
    share CLOCK_MONOTONIC, which the shared-memory puller's lease check
    relies on. The device number of /dev/shm tells a container with its own
    /dev/shm apart from the host it runs on (same kernel, other files). The
    hostname is there for people reading logs; it also keeps two machines
    apart should /proc be unreadable in some odd sandbox.
    """
    try:
        boot_id = BOOT_ID.read_text().strip()
        shm_device = os.stat(SHM_DIR).st_dev
    except OSError:
        return ""  # unknown: no puller will take this source for its own host's
    return f"{socket.gethostname()}/{boot_id}/{shm_device:x}"


class AutoSource(KVSource):
    """A pool in the /dev/shm segment `name` (or, on a GPU, a CUDA IPC allocation), also served on a ROUTER at
    `tcp://{host}:*`.

    `host` must be an address decode workers on other hosts can reach (the
    node's `host`, not 0.0.0.0). `host_id` defaults to `local_host_id()`;
    tests pass another to play a source on a different host.
    """

    def __init__(self, name: str, host: str = "127.0.0.1", host_id: str | None = None,
                 key: ClusterKey | None = None, device: str = "cpu") -> None:
        self.host_id = local_host_id() if host_id is None else host_id
        if device.startswith("cuda"):
            from pdrt.transport.cuda_ipc import CudaIpcSource

            self._local: KVSource = CudaIpcSource(name, device=device)
        else:
            self._local = ShmSource(name)
        self._tcp = TcpSource(name, host, key)
        self._descriptor: KVSourceDescriptor | None = None

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        pool = self._local.allocate(shape, dtype)
        try:
            self._tcp.serve(pool)
        except (TransferError, ConfigError):
            self._local.close()
            raise
        self._descriptor = msgspec.structs.replace(self._local.descriptor, backend=int(TransferBackend.AUTO),
                                                   host_id=self.host_id, tcp_address=self._tcp.descriptor.address)
        return pool

    @property
    def descriptor(self) -> KVSourceDescriptor:
        if self._descriptor is None:
            raise TransferError("the auto source has no pool yet; call allocate first")
        return self._descriptor

    @property
    def num_exports(self) -> int:
        return self._tcp.num_exports

    def export(self, request_id: str, block_ids: list[int], lease_expires_at: float, puller: str = "") -> None:
        self._local.export(request_id, block_ids, lease_expires_at, puller)
        self._tcp.export(request_id, block_ids, lease_expires_at, puller)

    def withdraw(self, request_id: str) -> None:
        self._local.withdraw(request_id)
        self._tcp.withdraw(request_id)

    def close(self) -> None:
        """Stop the TCP server first (it may be reading the pool), then unlink the segment."""
        self._tcp.close()
        self._local.close()


class AutoPuller(KVPuller):
    """Pulls from auto sources: by mapping their segment on this host, over TCP from any other.

    Call it from one thread, as the TCP puller requires. `host_id` defaults
    to `local_host_id()`; tests pass another to play a puller elsewhere.
    """

    def __init__(self, pool: torch.Tensor, host_id: str | None = None, identity: str = "",
                 key: ClusterKey | None = None) -> None:
        self.pool = pool
        self.identity, self.key = identity, key
        self.host_id = local_host_id() if host_id is None else host_id
        self._local: dict[TransferBackend, KVPuller] = {}  # same host: shared memory, or CUDA IPC for a GPU's pool
        self._tcp: TcpPuller | None = None

    def is_same_host(self, source: KVSourceDescriptor) -> bool:
        """Whether `source`'s segment is in this host's shared memory (an unknown host is never this one)."""
        return bool(source.host_id) and source.host_id == self.host_id

    def pull(self, source: KVSourceDescriptor, request_id: str, src_block_ids: list[int],
             dst_block_ids: list[int], lease_expires_at: float, timeout_s: float) -> None:
        if self.is_same_host(source):
            backend = TransferBackend.CUDA_IPC if source.ipc_handle else TransferBackend.SHM
            puller = self._local.get(backend)
            if puller is None:
                if backend == TransferBackend.CUDA_IPC:
                    from pdrt.transport.cuda_ipc import CudaIpcPuller

                    puller = CudaIpcPuller(self.pool)
                else:
                    puller = ShmPuller(self.pool)
                self._local[backend] = puller
            local = msgspec.structs.replace(source, backend=int(backend))
            puller.pull(local, request_id, src_block_ids, dst_block_ids, lease_expires_at, timeout_s)
            return
        if not source.tcp_address:
            raise TransferError(f"the KV source {source.address} is on another host ({source.host_id or 'unknown'}) "
                                "and serves no TCP endpoint")
        if self._tcp is None:
            self._tcp = TcpPuller(self.pool, self.identity, self.key)
        remote = msgspec.structs.replace(source, backend=int(TransferBackend.TCP), address=source.tcp_address)
        self._tcp.pull(remote, request_id, src_block_ids, dst_block_ids, lease_expires_at, timeout_s)

    def close(self) -> None:
        for puller in [*self._local.values(), self._tcp]:
            if puller is not None:
                puller.close()
        self._local.clear()
        self._tcp = None
