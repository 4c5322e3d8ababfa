"""Copies of KV blocks on a CUDA device: on a stream of the transfer thread's own, through pinned host memory where
they cross to or from the host, and waited for within a deadline.

A transfer thread's copies must not queue behind the worker's forward passes on the default stream, and must not
start from pageable host memory, which the driver copies through a small staging buffer of its own at a fraction
of the link's speed. `DeviceStaging` keeps, per transfer thread, a stream, a contiguous buffer on the device
(where runs of blocks are gathered or scattered, device to device) and a pinned host buffer (one copy across the
link each way); both grow to the largest pull and are reused.

A copy that has not finished by its deadline means a stuck device. It cannot be cancelled, and once the pull has
failed a late copy would write blocks the worker has since handed to another request: the process exits
(STUCK_EXIT) and the supervisor restarts it, its streams going on elsewhere as after any crash.
"""

import os
import time

import structlog
import torch

from pdrt.transport.copy import coalesce, copy_runs

log = structlog.get_logger(__name__)

STUCK_EXIT = 70  # EX_SOFTWARE
SPIN_S = 0.002  # a copy this short is waited for without sleeping
POLL_S = 0.0005


def wait(stream: torch.cuda.Stream, timeout_s: float, what: str) -> None:
    """Until the work queued on `stream` so far has finished; exits the process when it has not in `timeout_s`."""
    event = torch.cuda.Event()
    event.record(stream)
    started = time.monotonic()
    while not event.query():
        waited = time.monotonic() - started
        if waited > timeout_s:
            log.critical("a device copy did not finish in time: the device is stuck, the worker exits",
                         copy=what, timeout_s=timeout_s)
            os._exit(STUCK_EXIT)
        time.sleep(0 if waited < SPIN_S else POLL_S)


class DeviceStaging:
    """Moves runs of blocks between a pool on a CUDA device and contiguous host memory; one per transfer thread."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device)
        self._device: torch.Tensor | None = None
        self._pinned: torch.Tensor | None = None

    def gather(self, host: torch.Tensor, pool: torch.Tensor, block_ids: list[int], timeout_s: float) -> None:
        """Copy `pool`'s blocks `block_ids`, in that order, into `host`: `[layers, 2, len(block_ids), ...]`,
        contiguous, in pinned memory."""
        staged = self._device_buffer(host.shape, pool)
        with torch.cuda.stream(self.stream):
            copy_runs(staged, pool, coalesce(block_ids, list(range(len(block_ids)))))
            host.copy_(staged, non_blocking=True)
        wait(self.stream, timeout_s, "gather to the host")

    def scatter(self, pool: torch.Tensor, host: torch.Tensor, block_ids: list[int], timeout_s: float) -> None:
        """Copy `host` (`[layers, 2, len(block_ids), ...]`, any host memory) into `pool`'s blocks `block_ids`."""
        numel = host.numel()
        if self._pinned is None or self._pinned.numel() < numel or self._pinned.dtype != host.dtype:
            self._pinned = torch.empty(numel, dtype=host.dtype, pin_memory=True)
        pinned = self._pinned[:numel].view(host.shape)
        pinned.copy_(host)
        staged = self._device_buffer(host.shape, pool)
        with torch.cuda.stream(self.stream):
            staged.copy_(pinned, non_blocking=True)
            copy_runs(pool, staged, coalesce(list(range(len(block_ids))), block_ids))
        wait(self.stream, timeout_s, "scatter from the host")

    def _device_buffer(self, shape: torch.Size, pool: torch.Tensor) -> torch.Tensor:
        numel = shape.numel()
        if self._device is None or self._device.numel() < numel or self._device.dtype != pool.dtype:
            self._device = torch.empty(numel, dtype=pool.dtype, device=pool.device)
        return self._device[:numel].view(shape)
