"""The `pdrt up` supervisor: start a node's processes, keep them running, stop them in order.

Life of a run:
0. remove what runs whose supervisor was SIGKILLed left behind; check what
   would stop a process from starting that is visible from here (its ports
   taken, shared memory too small: preflight.py); take this run's lock (see
   leftovers.py);
1. write the resolved config as JSON into a fresh run directory (mode 0700),
   with the cluster key that authenticates the internal plane in
   `cluster.key` (0600: made for this run unless the config gives one), and start
   every process in `NodeConfig.process_names()` order (controller, workers,
   gateway), each told the config's path and the run id by environment;
2. monitor: every ~50 ms reap exited children, tell the controller at once
   (so that their streams move to other workers without waiting out a lease)
   and restart them with backoff (their leftover shared memory removed
   first); a child that exits with status 2 cannot start at all (its config,
   its model): the run stops with the cause it left in the run directory.
   One that crashes again and again before it serves makes the run give up;
   one that had served (it left its mark) is always restarted: what a
   request does to a worker never stops the node.
   Until the node is ready, ask the gateway whether every worker is alive
   (a node without a gateway asks the controller whether its workers are
   registered: readiness.py);
3. on SIGINT/SIGTERM/SIGHUP, on giving up, or on a readiness timeout: SIGTERM
   the gateway first (it drains open requests), then the workers, then the
   controller, each group waited for and SIGKILLed when late; a second signal
   SIGKILLs everything at once, and so does a failure before the node was
   ready (it has nothing to drain). Then remove the run's shared memory and
   the run directory.

Signal handlers only count signals; all the work happens in the monitor loop
of the main thread, so there is no reentrancy and no asyncio to reason about.
"""

import os
import secrets
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import structlog

from pdrt.actors.cluster_key import ClusterKey
from pdrt.devices import process_environments
from pdrt.errors import ConfigError
from pdrt.node_config import NodeConfig
from pdrt.process import EXIT_PERMANENT, FAILURE, SERVING
from pdrt.supervisor import leftovers, preflight
from pdrt.supervisor.child import Child, RestartPolicy, describe_exit
from pdrt.supervisor.readiness import check_controller, check_gateway, report_exit

log = structlog.get_logger(__name__)

CLUSTER_KEY_FILE = "cluster.key"
TICK_S = 0.05
PROBE_INTERVAL_S = 0.5
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
DEFAULT_POLICY = RestartPolicy()


def default_command(name: str) -> list[str]:
    return [sys.executable, "-m", "pdrt.process", name]


def new_run_id() -> str:
    return secrets.token_hex(4)


def _write_private(path: Path, data: bytes) -> None:
    """Write a file only its owner can read (it holds secrets)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


class Supervisor:
    """Runs one node's processes until told to stop; `run()` returns the exit code.

    `command_for(name)` gives the command of a process (tests pass small
    scripts); `ready_timeout_s=None` skips the readiness check, and
    `preflight=False` the checks before any start (preflight.py).
    """

    def __init__(self, config: NodeConfig, run_id: str, *, command_for: Callable[[str], list[str]] = default_command,
                 policy: RestartPolicy = DEFAULT_POLICY, ready_timeout_s: float | None = 300.0,
                 stop_timeout_s: float = 10.0, preflight: bool = True) -> None:
        self.config = config
        self.preflight = preflight
        self.run_id = run_id
        e = config.engine
        self.environments = process_environments(e.device, e.gpus, config.mode, config.worker_counts(),
                                                 config.transfer, config.process_names())  # refuses what cannot run
        self.command_for = command_for
        self.policy = policy
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.children: list[Child] = []
        self.run_dir: Path | None = None
        self.is_ready = False
        self.failure: str | None = None  # why the run ended badly, for people
        self._num_stop_requests = 0
        self._stop_requests_at_shutdown = 0
        self._log = log.bind(run_id=run_id)

    @property
    def worker_names(self) -> list[str]:
        return [name for name in self.config.process_names() if name not in ("controller", "gateway")]

    def request_stop(self) -> None:
        """What a stop signal does; callable from another thread too. A second call escalates to SIGKILL."""
        self._num_stop_requests += 1

    def run(self) -> int:
        previous = self._install_signal_handlers()
        lock, run_dir = None, None
        try:
            swept = leftovers.sweep_dead_runs()
            if swept:
                self._log.info("removed what dead runs left behind", runs=swept)
            if self.preflight:
                preflight.check(self.config)
            lock = leftovers.lock_run(self.run_id)
            run_dir = leftovers.make_run_dir(self.run_id)
            self._start_all(run_dir)
            self._monitor()
        except (OSError, ConfigError) as exc:
            self.failure = f"cannot start the node: {exc}"
        finally:
            self._shutdown()
            removed = leftovers.remove_segments(leftovers.run_prefix(self.run_id))
            if run_dir is not None:
                shutil.rmtree(run_dir, ignore_errors=True)
            leftovers.unlock_run(self.run_id, lock)
            self._log.info("node stopped", removed_segments=len(removed), failure=self.failure)
            self._restore_signal_handlers(previous)
        return 1 if self.failure else 0

    def _start_all(self, run_dir: Path) -> None:
        if not self.config.cluster_key:
            self.config = msgspec.structs.replace(self.config, cluster_key=ClusterKey.generate().text)
        _write_private(run_dir / CLUSTER_KEY_FILE, self.config.cluster_key.encode() + b"\n")
        config_path = run_dir / "node.json"
        _write_private(config_path, self.config.to_json())
        env = {**os.environ, "PDRT_NODE_CONFIG": str(config_path), "PDRT_RUN_ID": self.run_id,
               "PDRT_RUN_DIR": str(run_dir)}
        self.run_dir = run_dir
        self.children = [Child(name, self.command_for(name), {**env, **self.environments[name]}, self.policy)
                         for name in self.config.process_names()]
        self._log.info("starting node", mode=self.config.mode, why=self.config.mode_reason or None,
                       processes=[c.name for c in self.children],
                       config=str(config_path), device=self.config.engine.device,
                       gpus={name: v["CUDA_VISIBLE_DEVICES"] for name, v in self.environments.items() if v} or None)
        for child in self.children:
            self._start(child, time.monotonic())

    # -- monitoring -------------------------------------------------------------

    def _monitor(self) -> None:
        started = time.monotonic()
        next_probe = started
        problem = "readiness was never checked"
        while not self._num_stop_requests:
            now = time.monotonic()
            for child in self.children:
                if child.is_running:
                    if child.poll() is not None:
                        self._on_exit(child, now)
                elif child.is_restart_due(now):
                    self._start(child, now)
            if self.failure:
                return
            if not self.is_ready and self.ready_timeout_s is not None:
                if now >= next_probe:
                    problem = self._check_ready()
                    next_probe = time.monotonic() + PROBE_INTERVAL_S
                    if problem is None:
                        self._announce_ready()
                        continue
                if now - started >= self.ready_timeout_s:
                    self.failure = f"not ready after {self.ready_timeout_s:g} s: {problem}"
                    self._log.error("readiness timeout", problem=problem)
                    return
            time.sleep(TICK_S)

    def _start(self, child: Child, now: float) -> None:
        child.start(now)
        self._log.info("process started", process=child.name, pid=child.pid, start=child.num_starts)

    def _on_exit(self, child: Child, now: float) -> None:
        if child.name != "controller":
            report_exit(self.config.controller_address, self.config.key, f"supervisor-{self.run_id}", child.name,
                        child.incarnation)
        status = describe_exit(child.proc.returncode)
        removed = leftovers.remove_segments(leftovers.process_prefix(self.run_id, child.name))
        permanent = child.proc.returncode == EXIT_PERMANENT
        served = self._mark(child.name, SERVING) == child.incarnation
        delay = None if permanent else child.schedule_restart(now, served)
        self._log.warning("process exited", process=child.name, pid=child.pid, status=status,
                          uptime_s=round(now - child.started_at, 3), removed_segments=removed)
        if permanent:
            self.failure = f"{child.name} cannot start: {self._mark(child.name, FAILURE) or status}"
            self._log.error("giving up", process=child.name, cause=self.failure)
        elif delay is None:
            self.failure = (f"{child.name} crashed {child.num_startup_crashes} times in a row before it served "
                            f"(last: {status}); giving up")
            self._log.error("giving up", process=child.name, crashes=child.num_startup_crashes)
        else:
            self._log.info("restarting process", process=child.name, delay_s=delay,
                           crashes=child.num_startup_crashes)

    def _mark(self, name: str, kind: str) -> str | None:
        """What process `name` wrote down in the run directory (pdrt.process): why it cannot start (FAILURE), or
        the incarnation that began serving (SERVING)."""
        if self.run_dir is None:
            return None
        try:
            return (self.run_dir / f"{name}.{kind}").read_text().strip() or None
        except OSError:
            return None

    def _check_ready(self) -> str | None:
        if self.config.gateway.enabled:
            return check_gateway(self.config.gateway_address, self.worker_names)
        return check_controller(self.config.controller_address, self.worker_names, f"probe-{self.run_id}",
                                self.config.key)

    def _announce_ready(self) -> None:
        self.is_ready = True
        n = len(self.worker_names)
        if self.config.gateway.enabled:
            print(f"pdrt ready: {self.config.gateway_address} ({self.config.mode}, {n} workers)", flush=True)
            self._log.info("node ready", gateway=self.config.gateway_address)
        else:
            print(f"pdrt ready: {n} workers registered with {self.config.controller_address} "
                  f"({self.config.mode})", flush=True)
            self._log.info("node ready", controller=self.config.controller_address)

    # -- shutdown ----------------------------------------------------------------

    def _shutdown(self) -> None:
        """Gateway first (it stops accepting and drains), then workers, then the controller. A node that failed
        before it was ready holds no request: it is killed at once, so that its cause is told within seconds."""
        self._stop_requests_at_shutdown = self._num_stop_requests
        if self.failure and not self.is_ready:
            self._log.info("stopping node at once: it never served")
            self._kill_all()
            for child in self.children:
                child.reap(timeout_s=5.0)
            return
        by_name = {child.name: child for child in self.children}
        gateway = [by_name["gateway"]] if "gateway" in by_name else []
        controller = [by_name["controller"]] if "controller" in by_name else []
        workers = [c for c in self.children if c.name not in ("gateway", "controller")]
        self._log.info("stopping node")
        self._stop_group(gateway, self.config.experimental.drain_timeout_s + self.stop_timeout_s)
        self._stop_group(workers, self.stop_timeout_s)
        self._stop_group(controller, self.stop_timeout_s)
        for child in self.children:
            if not child.reap(timeout_s=5.0):
                self._log.error("process would not die", process=child.name, pid=child.pid)

    def _is_escalated(self) -> bool:
        return self._num_stop_requests > self._stop_requests_at_shutdown

    def _stop_group(self, group: list[Child], timeout_s: float) -> None:
        if self._is_escalated():
            self._kill_all()
            return
        for child in group:
            child.terminate()
        deadline = time.monotonic() + timeout_s
        while any(child.poll() is None for child in group if child.proc is not None):
            if self._is_escalated():
                self._log.warning("second stop signal: killing every process")
                self._kill_all()
                return
            if time.monotonic() >= deadline:
                late = [child.name for child in group if child.is_running]
                self._log.warning("processes did not stop in time; killing them", processes=late,
                                  timeout_s=timeout_s)
                for child in group:
                    child.kill()
                return
            time.sleep(TICK_S)

    def _kill_all(self) -> None:
        for child in self.children:
            child.kill()

    # -- signals -------------------------------------------------------------------

    def _install_signal_handlers(self) -> dict[int, object]:
        if threading.current_thread() is not threading.main_thread():
            return {}  # only the main thread may set handlers; request_stop() still works
        return {sig: signal.signal(sig, lambda signum, frame: self.request_stop()) for sig in STOP_SIGNALS}

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, object]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

