"""Any-host KV transfer: the prefill worker serves exported blocks over ZeroMQ, decode workers ask for them.

Protocol (structs at the end of pdrt.wire):

    decode DEALER  -- KVPullRequest(seq, request_id, block_ids) -->  prefill ROUTER
    prefill ROUTER -- [KVPullReply(seq, num_bytes), data]        -->  decode DEALER
                   or [KVPullReply(seq, error, message)]

The source's endpoint admits only holders of the cluster key, and answers
only the decode worker the request was routed to (the puller's identity is
its process id), for blocks exported under that request id, each named at
most once, and within their lease, judged on its own clock: the lease deadline is the
prefill host's `time.monotonic()`, meaningless on another host, so the
puller does not check it. The source gathers the blocks into one
contiguous buffer (one copy per run of consecutive ids) and sends it as a
zero-copy frame; it checks the export again after the gather, because a
withdraw during the gather may have let the prefill worker reuse the blocks
mid-read.

The puller writes the received frame straight into its pool, one copy per
run of consecutive destination blocks. A pool on a GPU is gathered and
scattered on the device, and crosses to and from the host through pinned
memory on the transfer thread's own stream (device_copy.py). A request
that times out takes its DEALER with it, and replies carry the request's
`seq`, so a late answer is never taken for the next request's.
"""

import math
import threading
import time

import msgspec
import structlog
import torch
import zmq

from pdrt.actors.cluster_key import ClusterKey
from pdrt.actors.sockets import SocketSpec, bound_address, make_socket
from pdrt.engine.torch_threads import serial_torch
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
from pdrt.transport.device_copy import DeviceStaging
from pdrt.wire import (
    KVPullReply,
    KVPullRequest,
    KVSourceDescriptor,
    encode,
    kv_pull_reply_decoder,
    kv_pull_request_decoder,
)

log = structlog.get_logger(__name__)

GATHER_TIMEOUT_S = 30.0  # a gather on a GPU not done by then: the device is stuck
SERVE_POLL_MS = 100  # how often the server thread looks at its stop flag: close() returns within about this
CLOSE_JOIN_S = 1.0


class TcpSource(BookedSource):
    """A prefill pool in ordinary memory, served by a thread on a ROUTER bound at `tcp://{host}:*`.

    `host` must be an address decode workers can reach: the descriptor
    advertises the bound endpoint as is (so not 0.0.0.0).
    """

    kind = "TCP"

    def __init__(self, name: str, host: str = "127.0.0.1", key: ClusterKey | None = None,
                 device: str = "cpu") -> None:
        super().__init__()
        self.name = name
        self.host = host
        self.key = key
        self.device = device
        self._pool: torch.Tensor | None = None
        self._ctx: zmq.Context | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._send_buffer = _SendBuffer()
        self._staging: DeviceStaging | None = None  # for a pool on a GPU

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self._pool is not None or self._stop.is_set():
            raise TransferError(f"KV source {self.name!r} is already allocated or closed")
        shape = tuple(shape)
        check_pool_shape(shape)
        return self.serve(torch.zeros(shape, dtype=dtype, device=self.device))

    def serve(self, pool: torch.Tensor) -> torch.Tensor:
        """Serve `pool`, storage allocated elsewhere (the auto backend's shared memory), instead of allocating."""
        if self._pool is not None or self._stop.is_set():
            raise TransferError(f"KV source {self.name!r} is already allocated or closed")
        check_pool_shape(tuple(pool.shape))
        self._ctx = zmq.Context(io_threads=1)
        try:
            sock = make_socket(self._ctx, SocketSpec(zmq.ROUTER, f"tcp://{self.host}:*", bind=True, key=self.key))
        except (ConfigError, zmq.ZMQError) as exc:
            self._ctx.term()
            self._ctx = None
            if isinstance(exc, ConfigError):  # `host` is not this host's: no restart mends that
                raise
            raise TransferError(f"cannot bind tcp://{self.host}:*: {exc}") from exc
        self._pool = pool
        self._descriptor = describe(TransferBackend.TCP, bound_address(sock), pool)
        # The socket moves to the server thread here and is used by it alone from now on.
        self._thread = threading.Thread(target=self._serve, args=(sock, pool), name=f"kv-source-{self.name}",
                                        daemon=True)
        if pool.is_cuda:
            self._staging = DeviceStaging(pool.device)
        self._thread.start()
        return pool

    def close(self) -> None:
        """Stop the server thread (within about SERVE_POLL_MS) and close its socket and context."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(CLOSE_JOIN_S)
            if self._thread.is_alive():  # stuck in a long gather: leave the context to the process's exit
                return
            self._thread = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self._pool = None

    # -- the server thread ------------------------------------------------

    def _serve(self, sock: zmq.Socket, pool: torch.Tensor) -> None:
        serial_torch()  # the worker's engine thread alone runs torch in parallel (pdrt/engine/torch_threads.py)
        try:
            while not self._stop.is_set():
                if sock.poll(SERVE_POLL_MS):
                    frames = sock.recv_multipart()
                    try:
                        self._answer(sock, pool, frames)
                    except Exception:  # whatever a pull asks, the server goes on serving the next one
                        log.exception("the KV source failed on a pull request")
        finally:
            sock.close()

    def _answer(self, sock: zmq.Socket, pool: torch.Tensor, frames: list[bytes]) -> None:
        if len(frames) != 2:  # [identity, request]; anything else is not from a puller
            return
        identity, payload = frames
        try:
            request = kv_pull_request_decoder.decode(payload)
        except (msgspec.DecodeError, RecursionError) as exc:
            reply = [encode(KVPullReply(-1, error="bad_request", message=f"undecodable pull request: {exc}"))]
        else:
            reply = self._blocks(pool, request, identity.decode(errors="replace"))
        try:
            tracker = sock.send_multipart([identity, *reply], flags=zmq.NOBLOCK, copy=False, track=True)
        except zmq.ZMQError:  # the puller left (ROUTER_MANDATORY says so instead of dropping silently) or is stuck
            return
        if len(reply) == 2:
            self._send_buffer.sending(tracker)

    def _blocks(self, pool: torch.Tensor, request: KVPullRequest, puller: str) -> list:
        """The reply frames: header and data, or an error header."""
        try:
            self._exports.check(request.request_id, request.block_ids, puller)
            if any(not 0 <= b < pool.shape[2] for b in request.block_ids):
                raise TransferError(f"block ids must be in [0, {pool.shape[2]})")
            data = self._send_buffer.take(pool, (pool.shape[0], 2, len(request.block_ids), *pool.shape[3:]))
            if self._staging is not None:
                self._staging.gather(data, pool, request.block_ids, GATHER_TIMEOUT_S)
            else:
                copy_runs(data, pool, coalesce(request.block_ids, list(range(len(request.block_ids)))))
            self._exports.check(request.request_id, request.block_ids, puller)
        except TransferError as exc:
            return [encode(KVPullReply(request.seq, error="refused", message=str(exc)))]
        buffer = data.view(-1).view(torch.uint8).numpy()
        return [encode(KVPullReply(request.seq, num_bytes=buffer.nbytes)), buffer]


class _SendBuffer:
    """Where gathered blocks wait for their zero-copy send; reused once libzmq is done with it.

    A fresh buffer of a hundred megabytes per reply costs more in page faults
    than the gather's copy itself, so the server keeps one, and takes a new one only while the last reply is still
    being sent (pyzmq keeps that one alive until then). For a pool on a GPU the buffer is pinned host memory.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._tracker: zmq.MessageTracker | None = None

    def take(self, pool: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        numel = math.prod(shape)
        busy = self._tracker is not None and not self._tracker.done
        if self._buffer is None or busy or self._buffer.numel() < numel:
            self._buffer = torch.empty(numel, dtype=pool.dtype, pin_memory=pool.is_cuda)
            self._tracker = None
        return self._buffer[:numel].view(shape)

    def sending(self, tracker: zmq.MessageTracker) -> None:
        self._tracker = tracker


class TcpPuller(KVPuller):
    """Pulls from TCP sources into `pool`, one DEALER per source address.

    Not thread-safe: ZeroMQ sockets belong to one thread, so call `pull` and
    `close` from the decode worker's single transfer thread. `identity` is
    the decode worker's process id, by which sources tell it is the one a
    request was routed to.
    """

    def __init__(self, pool: torch.Tensor, identity: str = "", key: ClusterKey | None = None) -> None:
        self.pool = pool
        self.identity = identity.encode() or None
        self.key = key
        self._ctx = zmq.Context(io_threads=1)
        self._sockets: dict[str, zmq.Socket] = {}
        self._seq = 0
        self._staging: DeviceStaging | None = DeviceStaging(pool.device) if pool.is_cuda else None

    def pull(self, source: KVSourceDescriptor, request_id: str, src_block_ids: list[int],
             dst_block_ids: list[int], lease_expires_at: float, timeout_s: float) -> None:
        """Copy the blocks or raise TransferError; `lease_expires_at` is the source's to check (its clock)."""
        check_pull(source, self.pool, src_block_ids, dst_block_ids)
        if not src_block_ids:
            return
        deadline = time.monotonic() + timeout_s
        self._seq += 1
        sock = self._socket(source.address)
        try:
            sock.send(encode(KVPullRequest(self._seq, request_id, list(src_block_ids))), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._drop(source.address)
            raise TransferError(f"cannot send a pull request to {source.address}: {exc}") from exc
        header, frames = self._receive(source.address, sock, deadline, timeout_s)
        if header.error:
            raise TransferError(f"{source.address} refused to send request {request_id!r}'s blocks: "
                                f"{header.message}")
        expected = block_bytes(source, len(src_block_ids))
        if len(frames) != 2 or header.num_bytes != expected or len(frames[1].buffer) != expected:
            self._drop(source.address)
            raise TransferError(f"{source.address} sent {[len(f.buffer) for f in frames[1:]]} bytes of blocks "
                                f"for request {request_id!r}; expected one frame of {expected}")
        shape = (source.num_layers, 2, len(src_block_ids), source.block_size, source.num_kv_heads, source.head_dim)
        blocks = torch.frombuffer(frames[1].buffer, dtype=torch_dtype(source.dtype)).view(shape)
        if self._staging is not None:
            self._staging.scatter(self.pool, blocks, dst_block_ids, max(0.0, deadline - time.monotonic()) + 1.0)
        else:
            copy_runs(self.pool, blocks, coalesce(list(range(len(dst_block_ids))), dst_block_ids))

    def _receive(self, address: str, sock: zmq.Socket, deadline: float,
                 timeout_s: float) -> tuple[KVPullReply, list[zmq.Frame]]:
        """The reply to request `self._seq`, skipping stale ones; on timeout the socket is dropped."""
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not sock.poll(remaining_ms):
                self._drop(address)
                raise TransferError(f"no answer from {address} within {timeout_s} s")
            frames = sock.recv_multipart(copy=False)
            try:
                header = kv_pull_reply_decoder.decode(frames[0].buffer)
            except msgspec.DecodeError as exc:
                self._drop(address)
                raise TransferError(f"malformed pull reply from {address}: {exc}") from exc
            if header.seq == self._seq:
                return header, frames

    def _socket(self, address: str) -> zmq.Socket:
        sock = self._sockets.get(address)
        if sock is None:
            try:
                sock = make_socket(self._ctx, SocketSpec(zmq.DEALER, address, bind=False, identity=self.identity,
                                                         key=self.key))
            except zmq.ZMQError as exc:
                raise TransferError(f"cannot connect to KV source {address}: {exc}") from exc
            self._sockets[address] = sock
        return sock

    def _drop(self, address: str) -> None:
        sock = self._sockets.pop(address, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self) -> None:
        for address in list(self._sockets):
            self._drop(address)
        self._ctx.term()
