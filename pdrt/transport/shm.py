"""Same-host KV transfer: the prefill pool lives in a /dev/shm file that decode workers map and copy from.

The source creates the file, reserves its memory up front and hands the
engine a tensor over a shared mapping of it, so prefill writes its KV
straight into memory the decode worker can read: a pull is one copy, from
the mapping into the decode pool, with no sockets in between.

Nothing on the source side takes part in a pull, so `export` and `withdraw`
only keep books; the lease is enforced by the puller, which checks the
deadline after copying (both workers share CLOCK_MONOTONIC on one host): a
copy that finished late may have read blocks the prefill worker had already
reused, and is reported as a failure.
"""

import errno
import mmap
import os
import re
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from pdrt.actors.cluster_key import ClusterKey
from pdrt.errors import ConfigError, TransferError
from pdrt.transport.base import KVPuller, TransferBackend
from pdrt.transport.copy import (
    BookedSource,
    block_bytes,
    check_pool_shape,
    check_pull,
    coalesce,
    copy_runs,
    describe,
    torch_dtype,
)
from pdrt.wire import KVSourceDescriptor

SHM_DIR = Path("/dev/shm")
MAX_MAPPINGS = 8
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


def segment_path(name: str) -> Path:
    """The path of segment `name`; the name must be a plain file name (letters, digits, '.', '_', '-')."""
    if not _SAFE_NAME.fullmatch(name):
        raise TransferError(f"unsafe shared-memory segment name {name!r}")
    return SHM_DIR / name


def remove_segments(prefix: str) -> int:
    """Unlink every segment whose name starts with `prefix` (those of crashed workers); returns how many."""
    segment_path(prefix)  # the same rules, and never an empty prefix that would match everything
    removed = 0
    for path in SHM_DIR.glob(f"{prefix}*"):
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:  # its owner closed it meanwhile
            pass
    return removed


class ShmSource(BookedSource):
    """A prefill pool in the /dev/shm file `name`; `host` and `key` are not needed: readers are on this host, and
    the file's mode (0600) lets only its user's processes map it."""

    kind = "shared-memory"

    def __init__(self, name: str, host: str = "", key: ClusterKey | None = None, device: str = "cpu") -> None:
        super().__init__()
        if device != "cpu":
            raise TransferError(f"a shared-memory KV pool is in host memory; the model is on {device}")
        self.path = segment_path(name)
        self._mmap: mmap.mmap | None = None
        self._pool: torch.Tensor | None = None
        self._closed = False

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self._pool is not None or self._closed:
            raise TransferError(f"{self.path} is already allocated or closed")
        shape = tuple(shape)
        check_pool_shape(shape)
        num_bytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise TransferError(f"cannot create {self.path}: {exc}") from exc
        try:
            # Reserve the memory now: a sparse tmpfs file that cannot grow later
            # kills the process with SIGBUS on a write, while this fails cleanly.
            os.posix_fallocate(fd, 0, num_bytes)
            self._mmap = mmap.mmap(fd, num_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except OSError as exc:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:  # the host's shared memory is too small for the pool: a restart won't do
                free = os.statvfs(SHM_DIR)
                raise ConfigError(f"cannot reserve {num_bytes} bytes in {self.path}: {SHM_DIR} has "
                                  f"{free.f_bavail * free.f_frsize} bytes free; lower [engine] kv_cache_bytes or "
                                  f"enlarge {SHM_DIR}") from exc
            raise TransferError(f"cannot reserve {num_bytes} bytes in {self.path}: {exc}") from exc
        os.close(fd)  # the mapping keeps the file's memory reachable
        self._pool = torch.frombuffer(self._mmap, dtype=dtype).view(shape)
        self._descriptor = describe(TransferBackend.SHM, str(self.path), self._pool)
        return self._pool

    def close(self) -> None:
        """Unlink the file and drop this source's references to the mapping.

        The mapping itself goes when its last tensor does: unmapping memory a
        tensor still points at would turn a late use into a segfault instead
        of a harmless read of a file nobody can open any more.
        """
        self._closed = True
        self._pool = None
        self._mmap = None
        self.path.unlink(missing_ok=True)


@dataclass(slots=True)
class _Mapping:
    inode: tuple[int, int]  # (st_dev, st_ino): a segment recreated under the same name is another one
    tensor: torch.Tensor  # keeps the read-only mapping alive


class ShmPuller(KVPuller):
    """Copies blocks out of mapped segments into `pool`; safe to call from several threads."""

    def __init__(self, pool: torch.Tensor, identity: str = "", key: ClusterKey | None = None) -> None:
        """`identity` and `key` are the TCP puller's: a segment is guarded by its file mode (0600) alone."""
        self.pool = pool
        self._mappings: OrderedDict[str, _Mapping] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def pull(self, source: KVSourceDescriptor, request_id: str, src_block_ids: list[int],
             dst_block_ids: list[int], lease_expires_at: float, timeout_s: float) -> None:
        check_pull(source, self.pool, src_block_ids, dst_block_ids)
        if time.monotonic() > lease_expires_at:
            raise TransferError(f"the lease of request {request_id!r} expired before the pull began")
        src = self._map(source)
        copy_runs(self.pool, src, coalesce(src_block_ids, dst_block_ids))
        if time.monotonic() > lease_expires_at:
            raise TransferError(f"the lease of request {request_id!r} expired during the pull; "
                                "the copied blocks may have been reused")

    def _map(self, source: KVSourceDescriptor) -> torch.Tensor:
        """The source's pool as a tensor, from the cache when the segment is the one mapped before."""
        path = source.address
        if segment_path(Path(path).name) != Path(path):
            raise TransferError(f"{path} is not a shared-memory segment")
        with self._lock:
            cached = self._mappings.get(path)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                # Unlinked (its worker closed or died): a mapping we hold is still valid memory.
                if cached is None:
                    raise TransferError(f"shared-memory segment {path} does not exist") from None
                self._mappings.move_to_end(path)
                return cached.tensor
            if cached is not None and cached.inode == (st.st_dev, st.st_ino):
                self._mappings.move_to_end(path)
                return cached.tensor
            mapping = self._open(source, path)
            self._mappings[path] = mapping
            self._mappings.move_to_end(path)
            while len(self._mappings) > MAX_MAPPINGS:
                self._mappings.popitem(last=False)
            return mapping.tensor

    @staticmethod
    def _open(source: KVSourceDescriptor, path: str) -> _Mapping:
        expected = block_bytes(source, source.num_blocks)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise TransferError(f"cannot open shared-memory segment {path}: {exc}") from exc
        try:
            st = os.fstat(fd)
            if st.st_size != expected:
                raise TransferError(f"{path} holds {st.st_size} bytes; its descriptor says {expected}")
            # Populate: a pull should not pay a page fault per 4 KiB of the source pool.
            mm = mmap.mmap(fd, expected, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        except OSError as exc:
            raise TransferError(f"cannot map {path}: {exc}") from exc
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            # The mapping is read-only on purpose; this tensor is only ever read.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            tensor = torch.frombuffer(mm, dtype=torch_dtype(source.dtype))
        shape = (source.num_layers, 2, source.num_blocks, source.block_size, source.num_kv_heads, source.head_dim)
        return _Mapping((st.st_dev, st.st_ino), tensor.view(shape))

    def close(self) -> None:
        with self._lock:
            self._mappings.clear()
