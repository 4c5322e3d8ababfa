"""Which cores each process of a CPU node runs on: decode workers on cores of their own.

A decode worker under load steps without pause, and every step it waits for
a core is a token late for each of its streams. Left to the kernel, the
node's processes spread over every core, and a prefill worker's prompt, the
gateway's streaming and the clients' reading all land on the decode worker's
core in turn. With `[experimental] own_cores = true` (a disaggregated node on the
CPU) each decode worker keeps its share of the cores to itself and the
prefill workers, the gateway and the controller share the rest: the CPU's
counterpart of giving decode a device of its own. A decode worker that
borrows idle prefill threads (pdrt/roles/thread_ledger.py) may also run on
the prefill workers' cores, where those threads are.

It is off by default (`[experimental] own_cores`): the split is static, and
on a host of few cores the rest is too small: the decode streams' TPOT gets
steadier, but over HTTP, where the gateway needs more of a core, prefill and
the gateway on one core break TTFT first.

The shares are the ones `pdrt systemd --pin-cpus` writes into the units'
CPUAffinity: consecutive cores in start order, as many as each worker's
threads. Every process works the plan out for itself from the config and
the cores it was started with, so processes started by `pdrt up` and by
systemd units agree. A node whose workers' threads outnumber its cores, or
that would have no core left besides its decode workers', is not pinned.
"""

import os

import structlog

from pdrt.node_config import NodeConfig, role_of

log = structlog.get_logger(__name__)


def worker_cores(config: NodeConfig, allowed: list[int]) -> dict[str, list[int]] | None:
    """Each worker of the node -> consecutive cores of `allowed` in start order, as many as its threads; None
    where they do not fit."""
    cores, first = {}, 0
    for name in config.process_names():
        if name in ("controller", "gateway"):
            continue
        n = config.threads_for(role_of(name))
        if first + n > len(allowed):
            return None
        cores[name], first = allowed[first:first + n], first + n
    return cores


def cores_for(config: NodeConfig, name: str, allowed: list[int], borrows: bool = False) -> list[int] | None:
    """The cores of process `name` ("decode-0", "gateway", ...) out of `allowed`, or None: any of them."""
    if not config.experimental.own_cores or config.mode != "disaggregated" or config.engine.device != "cpu":
        return None
    shares = worker_cores(config, allowed)
    if shares is None:
        return None
    decode = {core for worker, cores in shares.items() if role_of(worker) == "decode" for core in cores}
    rest = [core for core in allowed if core not in decode]
    if not decode or not rest:
        return None
    if role_of(name) != "decode":
        return rest
    lent = [core for worker, cores in shares.items() if role_of(worker) == "prefill" for core in cores]
    return shares[name] + lent if borrows else shares[name]


def allowed_cores() -> list[int]:
    """The cores this process was started on (a `taskset`, a systemd unit's CPUAffinity, a container's cpuset)."""
    return sorted(os.sched_getaffinity(0))


def _affinity(tid: int) -> set[int] | None:
    try:
        return os.sched_getaffinity(tid)
    except ProcessLookupError:  # the thread has ended
        return None


def pin(cores: list[int], name: str) -> None:
    """Run every thread of this process on `cores`; threads started later inherit it from their starter."""
    for _ in range(3):  # again, for a thread that a thread started while the last pass ran
        pending = [tid for tid in map(int, os.listdir("/proc/self/task")) if _affinity(tid) != set(cores)]
        if not pending:
            break
        for tid in pending:
            try:
                os.sched_setaffinity(tid, cores)
            except ProcessLookupError:  # the thread has ended
                pass
            except OSError as exc:  # a cpuset that changed under us: run on where it is
                log.warning("cannot pin the process to its cores", process=name, cores=cores, error=str(exc))
                return
    log.info("process pinned", process=name, cores=cores)
