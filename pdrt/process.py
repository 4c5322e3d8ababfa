"""Entry point of one pdrt process: `python -m pdrt.process NAME`, started by `pdrt up` (or systemd).

NAME is "controller", "gateway" or a worker such as "prefill-0", "decode-1",
"colocated-0". The node config comes as JSON in the file named by
`PDRT_NODE_CONFIG`; `PDRT_RUN_ID` names this run (shared-memory segments
carry it, so the supervisor can clean up after a crashed worker). Secrets
set in the environment (`PDRT_WARMUP_KEY`, `PDRT_API_KEY`, `PDRT_CLUSTER_KEY`:
a systemd unit's EnvironmentFile) take the place of the JSON's; a process
without a cluster key refuses to start. SIGTERM or
SIGINT stops the process in order: the gateway drains first, a worker closes
its KV source (removing its shared memory), and every process leaves the
controller's registry. A worker takes the CPU priority its profile gives
it once its model has loaded, since it depends on the model's size
(pdrt/worker_profile.py, pdrt/priority.py). With `[experimental] own_cores`
each decode worker of a disaggregated CPU node runs on cores of its own and
every other process on the rest (pdrt/cpu_placement.py).
"""

import asyncio
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import zmq.asyncio

from pdrt.actors.loop import run
from pdrt.cpu_placement import allowed_cores, cores_for, pin
from pdrt.errors import ConfigError, ModelLoadError, PdrtError
from pdrt.logs import configure_logging, quiet_transformers
from pdrt.node_config import NodeConfig, role_of, with_secrets

if TYPE_CHECKING:
    from pdrt.roles.engine_worker import EngineWorker

log = structlog.get_logger(__name__)

EXIT_PERMANENT = 2  # an error that a restart cannot mend: the config, or a model that cannot load
FAILURE, SERVING = "failure", "serving"  # the marks a process leaves in its run directory (_leave_mark)
MAX_CAUSE_CHARS = 1000


def _role(name: str) -> str:
    role = role_of(name)
    if role not in ("controller", "gateway", "prefill", "decode", "colocated"):
        raise ConfigError(f"unknown process {name!r}: expected controller, gateway, prefill-N, decode-N or "
                          "colocated-N")
    return role


def _place(config: NodeConfig, name: str, borrows: bool = False) -> None:
    cores = cores_for(config, name, allowed_cores(), borrows)
    if cores is not None:
        pin(cores, name)


def _worker(config: NodeConfig, name: str, role: str, incarnation: str, ctx: zmq.asyncio.Context,
            run_id: str) -> "EngineWorker":
    """The worker actor of `role`, its model loaded."""
    if role in ("prefill", "decode"):
        from pdrt.roles.split_worker import SplitWorker

        return SplitWorker(config, name, incarnation, ctx, run_id, role)
    from pdrt.roles.colocated_worker import ColocatedWorker

    return ColocatedWorker(config, name, incarnation, ctx)


async def serve(config: NodeConfig, name: str, run_id: str) -> None:
    if config.key is None:
        raise ConfigError("no cluster key: the internal plane admits only its holders. `pdrt up` makes one per run; "
                          "for units or other launchers, set PDRT_CLUSTER_KEY (`pdrt key` makes one)")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ctx = zmq.asyncio.Context()
    incarnation = os.environ.get("PDRT_INCARNATION") or uuid.uuid4().hex[:8]  # the supervisor's, to report exits
    role = _role(name)
    if role != "controller":
        quiet_transformers()
    if role in ("controller", "gateway"):
        _place(config, name)
    try:
        if role == "controller":
            from pdrt.control_plane.controller import Controller

            actor = Controller(config, ctx)
        elif role == "gateway":
            from pdrt.roles.gateway import Gateway

            actor = Gateway(config, name, incarnation, ctx)
        else:
            actor = _worker(config, name, role, incarnation, ctx, run_id)
            _place(config, name, borrows=actor.ledger is not None and actor.ledger.borrow)
            actor.take_priority()
        _leave_mark(name, SERVING, incarnation)
        await actor.serve(stop)
    finally:
        ctx.destroy(linger=0)
    log.info("process stopped", process=name)


def _leave_mark(name: str, kind: str, text: str) -> None:
    """Leave `text` where this process's supervisor reads it (the run directory), if it has one: why it cannot
    start (FAILURE), or the incarnation that started serving (SERVING)."""
    run_dir = os.environ.get("PDRT_RUN_DIR")
    if run_dir:
        try:
            Path(run_dir, f"{name}.{kind}").write_text(text)
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m pdrt.process NAME", file=sys.stderr)
        return 2
    name = argv[0]
    configure_logging(process=name)
    path = os.environ.get("PDRT_NODE_CONFIG")
    if path is None:
        log.error("PDRT_NODE_CONFIG is not set; this process is started by `pdrt up`")
        return 2
    try:
        with open(path, "rb") as f:
            config = with_secrets(NodeConfig.from_json(f.read()))  # PDRT_WARMUP_KEY, PDRT_API_KEY, ...
        run(serve(config, name, os.environ.get("PDRT_RUN_ID", "local")))
    except (ConfigError, ModelLoadError) as exc:  # retrying cannot help (neither pdrt up nor systemd retries 2)
        log.error("process cannot start", process=name, code=exc.code, error=str(exc))
        _leave_mark(name, FAILURE, " ".join(f"{exc.code}: {exc}".split())[:MAX_CAUSE_CHARS])  # one line
        # Out at once: tearing down an interpreter with a model loaded takes a second, and `pdrt up` waits for
        # the exit to tell its cause. Nothing is left to save (no request was taken); the kernel frees the rest.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_PERMANENT)
    except PdrtError as exc:
        log.error("process failed", process=name, code=exc.code, error=str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
