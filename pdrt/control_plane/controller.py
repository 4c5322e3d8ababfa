"""The controller process: registry of every process, leases, and the cluster view gateways route by.

Life cycle of a process in the controller:

1. `Register` (protocol version checked) -> `Registered` with the heartbeat
   period and lease; a newer incarnation of the same process id replaces the
   old one, which counts as lost;
2. `Heartbeat` every period renews the lease and carries the worker's load;
   a heartbeat from an incarnation the controller does not know gets
   `Error(code="unknown_process")`, and the process registers again (this is
   how processes recover from a controller restart);
3. a lease that runs out, a `ProcessExited` from the process's supervisor
   (its parent, which sees it exit at once), or a `Goodbye`, removes the
   process; every process gets `ProcessLost` for a lost one (gateways stop
   routing to it; workers drop a lost gateway's requests, which no client
   can receive any more, and free KV handed to a decode worker that
   exited), and gateways a fresh `ClusterView` either way;
4. a process declared lost that was only frozen heartbeats again: it is
   answered `Error(code="process_lost")` rather than `unknown_process`,
   registers again, and drops or sends on what it held, since its peers
   have already given it up.

A restarted controller knows nobody: for one lease it learns the cluster
from the processes that register again (they do when a heartbeat is
answered with `unknown_process`), declares nobody lost, and sends gateways
views marked incomplete, from which they drop nobody.

Gateways also get the `ClusterView` every heartbeat period, so their view of
the load is never older than that.

Only holders of the cluster key connect at all (pdrt/actors/cluster_key.py).
Among them, a process speaks only for itself: a `Register`, `Heartbeat`,
`Goodbye` or `MetricsReport` must come from the link identity of the
process and incarnation it names (`link_identity`), else it is dropped.

A disaggregated node's workers change roles in place when an operator asks
(`SetRole`, from any holder of the cluster key) or the balancer decides
(pdrt/control_plane/role_changes.py), and a crowded decode worker sends
streams on to the one with the fewest (pdrt/control_plane/stream_balance.py).

Every process also reports its metrics (`MetricsReport`); the controller
merges them (pdrt.metrics.aggregator), serves the result on its metrics port,
and sends it to the gateways (`MetricsView`) at most once a second.
"""

import asyncio
import os
import time
from collections import OrderedDict

import msgspec
import structlog
import zmq
import zmq.asyncio

from pdrt.actors.actor import Actor, FromPeer, Tick
from pdrt.actors.sockets import SocketSpec, make_socket, send_now
from pdrt.bench.stats import Slo
from pdrt.control_plane.balancer import Balancer
from pdrt.control_plane.link import link_identity
from pdrt.control_plane.role_changes import RoleChanges
from pdrt.control_plane.stream_balance import StreamBalance
from pdrt.metrics.aggregator import MetricsAggregator
from pdrt.metrics.metrics_server import MetricsServer
from pdrt.node_config import NodeConfig
from pdrt.planner.profile import default_profile_path
from pdrt.wire import (
    PROTOCOL_VERSION,
    ClusterView,
    Error,
    Goodbye,
    Heartbeat,
    MetricsReport,
    MetricsView,
    ProcessExited,
    ProcessLost,
    Register,
    Registered,
    RoleChanged,
    SetRole,
    encode,
    internal_decoder,
)
from pdrt.worker_profile import prefill_nice

from .registry import Entry, Registry

log = structlog.get_logger(__name__)

METRICS_VIEW_S = 1.0  # how often gateways get the merged metrics
MAX_REMEMBERED_LOST = 4096  # incarnations declared lost, told so if they heartbeat again
ROLES = ("gateway", "prefill", "decode", "colocated")
SPOKEN_FOR_ONESELF = (Register, Heartbeat, Goodbye, MetricsReport, RoleChanged)


class Controller(Actor):
    """An actor: frames from its socket and its own ticks arrive as messages, handled one at a time."""

    def __init__(self, config: NodeConfig, ctx: zmq.asyncio.Context) -> None:
        self.heartbeat_s = config.experimental.heartbeat_s
        self.registry = Registry(config.experimental.lease_s)
        self.recovering_until = time.monotonic() + config.experimental.lease_s
        self.socket = make_socket(ctx, SocketSpec(zmq.ROUTER, config.controller_address, bind=True, key=config.key))
        self.metrics = MetricsAggregator(self.registry)
        self.roles = RoleChanges(self.registry, self._send, self.metrics.registry)
        self.metrics_server = MetricsServer(config.host, config.controller.metrics_port, lambda: self.metrics.snapshot)
        self.metrics_sent_at = 0.0
        c = config.controller
        self.balancer = Balancer(self.registry, self.roles, c.balance, c.balance_interval_s,
                                 Slo(config.gateway.ttft_slo_s, config.gateway.tpot_slo_s),
                                 config.threads_for("decode"), os.cpu_count() or 1, default_profile_path(config.model),
                                 self.metrics.registry, prefill_nice(config))
        self.balancing: asyncio.Task | None = None
        self.declared_lost: OrderedDict[bytes, None] = OrderedDict()  # link identities
        self.streams = StreamBalance(self.registry, self._send, lambda: set(self.roles.pending), c.balance,
                                     config.gateway.tpot_slo_s, self.metrics.registry)

    def _send(self, identity: bytes, message: msgspec.Struct) -> None:
        try:
            send_now(self.socket, [identity, encode(message)])
        except zmq.ZMQError as exc:  # the peer is gone (ROUTER_MANDATORY) or not reading
            log.debug("controller could not reach a process", identity=identity, error=str(exc))

    def _broadcast_view(self) -> None:
        view = ClusterView(self.registry.workers(), complete=time.monotonic() >= self.recovering_until)
        for gateway in self.registry.by_role("gateway"):
            self._send(gateway.identity, view)

    def _lost(self, entry: Entry, why: str) -> None:
        log.warning("process lost", process=entry.process_id, incarnation=entry.incarnation, why=why)
        self.roles.lost(entry.process_id)
        self.declared_lost[entry.identity] = None
        while len(self.declared_lost) > MAX_REMEMBERED_LOST:
            self.declared_lost.popitem(last=False)
        lost = ProcessLost(entry.process_id, entry.incarnation, entry.address, exited=why == "exited")
        for peer in self.registry.entries.values():
            self._send(peer.identity, lost)

    async def on_receive(self, message: object) -> None:
        match message:
            case Tick():
                if time.monotonic() >= self.recovering_until:
                    for entry in self.registry.expire():
                        self._lost(entry, "lease expired")
                self.roles.expire()
                self.streams.tick()
                self._broadcast_view()
                self._forward_metrics()
                self.balancer.sample(self.metrics.snapshot, time.monotonic())
                if self.balancer.due(time.monotonic()):
                    self.balancing = asyncio.create_task(self._balance())
            case FromPeer(identity=identity, message=request):
                self.handle(identity, request)

    async def _balance(self) -> None:
        try:
            changed = await self.balancer.evaluate()
        except Exception:  # a failed evaluation changes nothing; the next one tries again
            log.exception("balancer evaluation failed")
            return
        if changed:
            self._broadcast_view()

    def _forward_metrics(self) -> None:
        self.metrics.refresh()
        gateways = self.registry.by_role("gateway")
        if gateways and time.monotonic() - self.metrics_sent_at >= METRICS_VIEW_S:
            self.metrics_sent_at = time.monotonic()
            view = MetricsView(self.metrics.exposition())
            for gateway in gateways:
                self._send(gateway.identity, view)

    def handle(self, identity: bytes, message: object) -> None:
        if isinstance(message, ProcessExited):  # from its supervisor, for a child that exited
            entry = self.registry.remove(message.process_id, message.incarnation)
            if entry is not None:
                self._lost(entry, "exited")
                self._broadcast_view()
            return
        if isinstance(message, SetRole):
            why = self.roles.start(message.process_id, message.role, "asked by an operator", requester=identity)
            if why is None:
                self._broadcast_view()
            else:
                self._send(identity, Error("invalid_request", why))
            return
        if not isinstance(message, SPOKEN_FOR_ONESELF):
            log.warning("controller ignored a message", message=type(message).__name__)
            return
        if identity != link_identity(message.process_id, message.incarnation):
            log.warning("controller dropped a message sent in another process's name", identity=identity[:64],
                        message=type(message).__name__, process=message.process_id[:64])
            return
        if isinstance(message, Heartbeat):
            if not self.registry.heartbeat(message.process_id, message.incarnation, message.load):
                if identity in self.declared_lost:  # frozen, not forgotten by a restarted controller
                    self._send(identity, Error("process_lost", f"{message.process_id} was declared lost and its "
                                                               "peers gave up what it held; register again"))
                else:
                    self._send(identity, Error("unknown_process", f"{message.process_id} must register again"))
        elif isinstance(message, MetricsReport):
            self.metrics.report(message)
        elif isinstance(message, RoleChanged):
            if self.roles.confirmed(message) and message.role == "decode":
                self.streams.join(message.process_id)
        elif isinstance(message, Register):
            if message.protocol_version != PROTOCOL_VERSION:
                self._send(identity, Error("unsupported_version", f"controller speaks protocol {PROTOCOL_VERSION}, "
                                                                  f"not {message.protocol_version}"))
                return
            if message.role not in ROLES:
                self._send(identity, Error("invalid_frame", f"no role {message.role!r}: one of {', '.join(ROLES)}"))
                return
            self.declared_lost.pop(identity, None)
            replaced = self.registry.register(message.process_id, message.incarnation, message.role,
                                              message.address, identity)
            log.info("process registered", process=message.process_id, role=message.role, address=message.address)
            self._send(identity, Registered(self.heartbeat_s, self.registry.lease_s))
            if replaced is not None:
                self._lost(replaced, "replaced by a new incarnation")
            self._broadcast_view()
        elif self.registry.remove(message.process_id, message.incarnation) is not None:  # Goodbye
            log.info("process left", process=message.process_id)
            self.roles.lost(message.process_id)
            self._broadcast_view()

    async def _read(self, ref) -> None:
        while True:
            identity, frame = (await self.socket.recv_multipart())[:2]
            try:
                message = internal_decoder.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
                self._send(identity, Error("invalid_frame", str(exc)))
                continue
            await ref.deliver(FromPeer(identity, message))

    async def _tick(self, ref) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            await ref.deliver(Tick())

    async def serve(self, stop: asyncio.Event) -> None:
        # The lease in which processes register again runs from when their heartbeats can be read, not from
        # construction: on a busy host the two can be seconds apart, and a view marked complete too early would
        # make the gateways drop every worker that had not registered yet.
        self.recovering_until = time.monotonic() + self.registry.lease_s
        log.info("controller serving", heartbeat_s=self.heartbeat_s, lease_s=self.registry.lease_s)
        ref = self.start()
        tasks = [asyncio.create_task(self._read(ref)), asyncio.create_task(self._tick(ref))]
        if self.metrics_server.port:
            self.metrics_server.start()
        try:
            await stop.wait()
        finally:
            for task in tasks + ([self.balancing] if self.balancing else []):
                task.cancel()
            await ref.stop()
            await self.metrics_server.close()
            self.socket.close()
