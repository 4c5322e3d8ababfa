"""One thread of a worker process runs torch's parallel work; every other thread that touches tensors runs it
inline.

torch's CPU kernels run on OpenMP (libgomp), and each thread that starts a
parallel region gets a team of its own, which lives as long as the thread.
Between two regions a team's threads spin for a while before they sleep,
but only while libgomp's threads fit the machine's cores: once a second team
exists, every team sleeps at once, and each of the several hundred regions
of a decode step waits for its threads to wake, while a core idles. So a worker
builds its engine and runs every step on its engine thread, and any other
thread that copies tensors (KV transfers, the event loop applying ops)
calls `serial_torch` first.
"""

import torch


def serial_torch() -> None:
    """Run this thread's torch ops on the thread itself, never in a parallel team of its own."""
    torch.set_num_threads(1)
