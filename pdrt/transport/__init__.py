"""KV transfer between workers: the interface, and a factory that picks a backend by enum.

Backend modules are imported only when first chosen, so a backend's heavy or
optional dependencies (cuda-python, for a CUDA IPC backend) load only in the
processes that use it. Adding a backend means a `TransferBackend` value and a
row in `_BACKENDS`; callers of `make_source` and `make_puller` do not change.
"""

import importlib

import torch

from pdrt.actors.cluster_key import ClusterKey
from pdrt.errors import TransferError
from pdrt.transport.base import KVPuller, KVSource, TransferBackend
from pdrt.wire import KVSourceDescriptor

__all__ = ["KVPuller", "KVSource", "TransferBackend", "make_puller", "make_source"]

# backend -> (module, source class, puller class); the classes take (name, host, key=, device=) and
# (pool, identity=, key=).
_BACKENDS: dict[TransferBackend, tuple[str, str, str]] = {
    TransferBackend.SHM: ("pdrt.transport.shm", "ShmSource", "ShmPuller"),
    TransferBackend.TCP: ("pdrt.transport.tcp", "TcpSource", "TcpPuller"),
    TransferBackend.AUTO: ("pdrt.transport.auto", "AutoSource", "AutoPuller"),
    TransferBackend.CUDA_IPC: ("pdrt.transport.cuda_ipc", "CudaIpcSource", "CudaIpcPuller"),
}


def _backend_class(backend: int, index: int) -> type:
    try:
        row = _BACKENDS[TransferBackend(backend)]
    except (ValueError, KeyError):
        raise TransferError(f"no KV transfer backend {backend}") from None
    return getattr(importlib.import_module(row[0]), row[index])


def make_source(backend: TransferBackend, name: str, host: str, key: ClusterKey | None = None,
                device: str = "cpu") -> KVSource:
    """A prefill worker's source: `name` is unique per worker incarnation, `host` where peers reach it, `key`
    the cluster key that its endpoint (if any) admits pullers by, `device` where its model runs."""
    return _backend_class(backend, 1)(name, host, key=key, device=device)


def make_puller(pool: torch.Tensor, identity: str = "", key: ClusterKey | None = None) -> KVPuller:
    """A decode worker's puller into `pool`, for sources of any backend; `identity` is the worker's process id,
    which sources check against the decode worker a request was routed to."""
    return _AnyBackendPuller(pool, identity, key)


class _AnyBackendPuller(KVPuller):
    """Hands each pull to the puller of its descriptor's backend, created on first use.

    One decode worker may receive from prefill workers of several backends.
    Call it from one transfer thread, as the TCP puller requires.
    """

    def __init__(self, pool: torch.Tensor, identity: str, key: ClusterKey | None) -> None:
        self.pool = pool
        self.identity, self.key = identity, key
        self._pullers: dict[int, KVPuller] = {}

    def pull(self, source: KVSourceDescriptor, request_id: str, src_block_ids: list[int],
             dst_block_ids: list[int], lease_expires_at: float, timeout_s: float) -> None:
        puller = self._pullers.get(source.backend)
        if puller is None:
            puller = self._pullers[source.backend] = _backend_class(source.backend, 2)(self.pool,
                                                                                       identity=self.identity,
                                                                                       key=self.key)
        puller.pull(source, request_id, src_block_ids, dst_block_ids, lease_expires_at, timeout_s)

    def close(self) -> None:
        for puller in self._pullers.values():
            puller.close()
        self._pullers.clear()
