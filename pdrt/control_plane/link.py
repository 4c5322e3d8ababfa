"""Every process's connection to the controller: register, then heartbeat with its load, for as long as it runs.

The link registers (retrying until the controller answers), heartbeats every
period the controller asked for, registers again when the controller no
longer knows it (a restarted controller, or one that declared this process
lost while it was frozen: that `process_lost` error goes to `on_message`
too, since the process's peers gave up what it held), and hands whatever
else the controller sends (cluster views, lost processes) to `on_message`. `close`
says goodbye so the process leaves the registry at once. Every second it
also reports the process's metrics (`MetricsReport`), which the controller
merges (pdrt.metrics).
"""

import asyncio
from collections.abc import Callable

import msgspec
import structlog
import zmq
import zmq.asyncio

from pdrt.actors.cluster_key import ClusterKey
from pdrt.actors.sockets import SocketSpec, make_socket, send_now
from pdrt.metrics.process_metrics import process_exposition
from pdrt.wire import (
    PROTOCOL_VERSION,
    Error,
    Goodbye,
    Heartbeat,
    Load,
    MetricsReport,
    Register,
    Registered,
    encode,
    internal_decoder,
)

log = structlog.get_logger(__name__)

REGISTER_TIMEOUT_S = 2.0
METRICS_REPORT_S = 1.0


def link_identity(process_id: str, incarnation: str) -> bytes:
    """How the controller knows a process's link: its messages must come from the one it registered with."""
    return f"{process_id}.{incarnation}".encode()


class ControllerLink:
    def __init__(self, ctx: zmq.asyncio.Context, controller_address: str, process_id: str, incarnation: str,
                 role: str, address: str, load: Callable[[], Load],
                 on_message: Callable[[object], None] | None = None,
                 metrics: Callable[[], bytes | None] = process_exposition, key: ClusterKey | None = None) -> None:
        self.process_id = process_id
        self.incarnation = incarnation
        self.role = role
        self.address = address
        self.load = load
        self.on_message = on_message
        self.metrics = metrics
        self.socket = make_socket(ctx, SocketSpec(zmq.DEALER, controller_address, bind=False,
                                                  identity=link_identity(process_id, incarnation), key=key))
        self.registered = asyncio.Event()
        self.heartbeat_s = 0.25
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._beat()),
                       asyncio.create_task(self._report())]

    def send(self, message: msgspec.Struct) -> None:
        """To the controller, now; a failure is logged (the controller is restarting: it will be asked again)."""
        try:
            send_now(self.socket, [encode(message)])
        except zmq.ZMQError as exc:
            log.warning("controller link could not send", error=str(exc))

    def _register(self) -> None:
        self.registered.clear()
        self.send(Register(PROTOCOL_VERSION, self.process_id, self.incarnation, self.role, self.address))

    async def _read(self) -> None:
        while True:
            frame = await self.socket.recv()
            try:
                message = internal_decoder.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
                log.warning("controller link dropped an undecodable frame", error=str(exc))
                continue
            if isinstance(message, Registered):
                self.heartbeat_s = message.heartbeat_s
                self.registered.set()
            elif isinstance(message, Error) and message.code in ("unknown_process", "process_lost"):
                if self.registered.is_set():  # one registration, however many heartbeats it answers
                    log.warning("the controller does not know this process; registering again", code=message.code)
                    self.registered.clear()
                    if message.code == "process_lost" and self.on_message is not None:
                        self.on_message(message)
            elif isinstance(message, Error):
                log.error("the controller refused this process", code=message.code, error=message.message)
            elif self.on_message is not None:
                self.on_message(message)

    async def _beat(self) -> None:
        while True:
            self._register()
            while not self.registered.is_set():
                try:
                    await asyncio.wait_for(self.registered.wait(), REGISTER_TIMEOUT_S)
                except TimeoutError:
                    log.warning("controller did not answer the registration; retrying")
                    self._register()
            while self.registered.is_set():
                self.send(Heartbeat(self.process_id, self.incarnation, self.load()))
                await asyncio.sleep(self.heartbeat_s)

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(METRICS_REPORT_S)
            try:
                exposition = self.metrics()
            except Exception:  # a broken collector costs the metrics, never the link
                log.exception("metrics could not be collected")
                continue
            if exposition is not None and self.registered.is_set():
                self.send(MetricsReport(self.process_id, self.incarnation, self.role, exposition))

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.send(Goodbye(self.process_id, self.incarnation))
        self.socket.close(linger=200)  # give the goodbye a moment to leave
