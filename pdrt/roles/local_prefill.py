"""Conditional disaggregation: when a decode worker should prefill a prompt itself. A policy of the gateway.

The gateway asks twice. When a prompt arrives (`LocalPrefill.on_decode`), a
short one behind a backlog goes to its decode worker if that worker's recent
steps leave room (`LocalPrefillRules.may_prefill_on_decode`) and its stall
keeps every stream there within its TPOT bound (`stall_fits`). While prompts
wait (`LocalPrefill.move`, every gateway tick), when the prefill worker's own
account of its queue says some will miss the TTFT SLO, the one whose move
leaves the fewest late moves to its decode worker, under the same bound
(`LocalPrefillRules.prompt_to_move`): a burst of prompts builds the queue
after they arrived, where the first rule cannot see.

`LocalPrefillRules` are the decisions on plain numbers; `LocalPrefill`
applies them to a gateway's open requests and the workers' loads.
"""

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdrt.node_config import NodeConfig
from pdrt.roles.gateway_request import GatewayRequest
from pdrt.roles.prefix_memory import PrefixMemory
from pdrt.roles.router import Router
from pdrt.wire import Load, WorkerInfo

# Of the slack `max_slowdown` leaves a stream over its plain steps, what local prefills may spend over the
# stream's life: with all of it, a stream's TPOT p99 under long prompts drifted well past its mean's bound.
LIFE_SLACK_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class LocalPrefillRules:
    """A prompt of at most `max_tokens` (0: none, and no moves either) may be prefilled by its decode worker
    while the prefill workers have at least `queue_tokens` waiting, and only while that worker's recent steps,
    its stalls included, average under the TPOT SLO and under `max_slowdown` times its steps that only decode:
    the stall is paid by the requests decoding there, and disaggregation exists to bound it."""

    max_tokens: int = 512
    queue_tokens: int = 512
    max_slowdown: float = 1.25
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.1

    @classmethod
    def of(cls, config: NodeConfig) -> "LocalPrefillRules":
        x = config.experimental
        return cls(x.local_prefill_max_tokens, x.local_prefill_queue_tokens, x.local_prefill_max_slowdown,
                   config.gateway.ttft_slo_s, config.gateway.tpot_slo_s)

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def may_prefill_on_decode(self, num_prompt_tokens: int, backlog_tokens: int, decode: Load) -> bool:
        """Whether a prompt should be prefilled by its decode worker rather than queue behind `backlog_tokens`.

        Each local prefill lengthens the decode worker's average step, so it
        takes the next one only once its streams are back within the bound.
        """
        if not 0 < num_prompt_tokens <= self.max_tokens:
            return False
        if backlog_tokens < self.queue_tokens:
            return False
        if decode.num_running == 0:
            return True
        if decode.decode_step_s <= 0.0:
            return False  # every recent step stalled for a prefill
        return decode.step_s < min(self.tpot_slo_s, self.max_slowdown * decode.decode_step_s)

    def tpot_bound(self, decode: Load) -> float:
        """What a stream on `decode` may average between its tokens over its life, stalls included: under the
        TPOT SLO and under its plain decode steps plus LIFE_SLACK_SHARE of what `max_slowdown` allows over them
        (0.0 while those are unknown). The slowdown bound is the isolation disaggregation exists for."""
        if decode.decode_step_s <= 0.0:
            return 0.0
        slowdown = 1.0 + LIFE_SLACK_SHARE * (self.max_slowdown - 1.0)
        return min(self.tpot_slo_s, slowdown * decode.decode_step_s)

    def prompt_to_move(self, queue: list[tuple[GatewayRequest, float]], now: float,
                       seconds_elsewhere: Callable[[GatewayRequest], float | None]) -> GatewayRequest | None:
        """The prompt whose move to its decode worker leaves the fewest of a prefill worker's prompts late, if
        fewer than stay late without a move.

        `queue` holds the worker's waiting prompts, each with the seconds until
        its first token there, in the order the worker serves them. A move takes
        the prompt's own seconds off every prompt after it; on its decode worker
        it gets its first token after `seconds_elsewhere` (None: it cannot go).
        Of moves that leave as many late, the last prompt's goes: it is the
        least likely to have started by the time the worker is asked (its
        account is a heartbeat old).
        """
        def late(req: GatewayRequest, seconds: float) -> bool:
            return now - req.admitted_at + seconds > self.ttft_slo_s

        queue = sorted(queue, key=lambda item: item[1])
        stay_late = sum(late(req, seconds) for req, seconds in queue)
        if not stay_late:
            return None
        best, fewest = None, stay_late - 1
        previous = 0.0
        for i, (req, seconds) in enumerate(queue):
            own, previous = seconds - previous, seconds
            elsewhere = seconds_elsewhere(req)
            if elsewhere is None:
                continue
            num_late = (sum(late(r, s) for r, s in queue[:i]) + late(req, elsewhere)
                        + sum(late(r, s - own) for r, s in queue[i + 1:]))
            if num_late <= fewest:
                best, fewest = req, num_late
        return best


def stall_fits(streams: Iterable[GatewayRequest], stall_s: float, step_s: float, bound_s: float, now: float) -> bool:
    """Whether every stream, stalled `stall_s` more and then taking `step_s` a token up to its `max_tokens`, would
    average at most `bound_s` between its tokens over its whole life (TPOT is that average). A stream without a
    token yet counts as one that starts now: it will be decoding when the stall comes."""
    for req in streams:
        num_tokens = max(1, len(req.token_ids))
        elapsed = now - req.first_token_at if req.token_ids else 0.0
        total = max(req.params.max_tokens, num_tokens + 1)
        if elapsed + stall_s + (total - num_tokens) * step_s > bound_s * (total - 1):
            return False
    return True


def first_token_seconds(work_until: dict[str, int], gone: Callable[[str], bool], tokens_per_s: float
                        ) -> dict[str, float]:
    """A prefill worker's account of its prompts without a first token (`Load.first_token_work`) as seconds until
    each one's first token, at `tokens_per_s`; the work of prompts `gone` from it since (moved, cancelled) taken
    out."""
    seconds: dict[str, float] = {}
    previous = removed = 0
    for request_id, work in sorted(work_until.items(), key=lambda item: item[1]):
        own, previous = work - previous, work
        if gone(request_id):
            removed += own
        else:
            seconds[request_id] = (work - removed) / tokens_per_s
    return seconds


class LocalPrefill:
    """The rules applied to one gateway's open requests (`requests`: attempt id -> request) and the workers'
    loads (`router`); `prefixes` says which prompt blocks each worker holds, so a cached prefix costs nothing."""

    def __init__(self, rules: LocalPrefillRules, router: Router, prefixes: PrefixMemory,
                 requests: dict[str, GatewayRequest], process_id: str) -> None:
        self.rules = rules
        self.router = router
        self.prefixes = prefixes
        self.requests = requests
        self.ours = f"{process_id}-"  # the prefix of this gateway's attempt ids

    def on_decode(self, req: GatewayRequest, prefill: WorkerInfo, decode: WorkerInfo, now: float) -> bool:
        """Whether `decode` should prefill `req` itself rather than queue it on `prefill`.

        When every prefill worker is backed up, a short prompt waits there for
        the whole queue, while a decode worker, which runs without a break but
        often well within its TPOT SLO, computes it in one step of its own. The
        backlog is this gateway's prompts that `prefill` has not answered yet,
        and one such prompt at a time goes to a decode worker, if its stall
        keeps the requests there within their TPOT bound (once the workers'
        prefill rates are known).
        """
        backlog = 0
        for other in self.requests.values():
            if not other.awaits_first_token or other.prefill is None:
                continue
            if other.prefill.process_id == prefill.process_id:
                backlog += len(other.route_token_ids())
            elif other.prefill.process_id == decode.process_id:
                return False  # its local prefill is still running
        if not self.rules.may_prefill_on_decode(len(req.route_token_ids()), backlog, decode.load):
            return False
        rate = prefill.load.prefill_tokens_per_s
        return rate <= 0.0 or self.seconds_on_decode(req, decode, rate, now) is not None

    def seconds_on_decode(self, req: GatewayRequest, decode: WorkerInfo, prefill_rate: float, now: float
                          ) -> float | None:
        """Seconds until `req`'s first token if `decode` prefilled it, behind the prompts it prefills already
        (at its recent prefill rate, else `prefill_rate`; its cached prefix aside); None when that stall would
        take a request decoding there, or to decode there next, past its TPOT bound (`stall_fits`)."""
        local_tokens, others = 0, []
        for other in self.requests.values():
            if other is req or other.prefill is None:
                continue
            if other.decode is not None and other.decode.process_id == decode.process_id:
                others.append(other)
            elif other.decode is None and other.prefill.process_id == decode.process_id:
                others.append(other)
                local_tokens += len(other.route_token_ids()) if other.awaits_first_token else 0
        seconds = (local_tokens + self.uncached_tokens(req, decode.process_id)) / (
            decode.load.prefill_tokens_per_s or prefill_rate)
        if others and not stall_fits(others, seconds, decode.load.decode_step_s, self.rules.tpot_bound(decode.load),
                                     now):
            return None
        return seconds

    def uncached_tokens(self, req: GatewayRequest, process_id: str) -> int:
        """The tokens of `req`'s prompt that worker `process_id` would compute: those past the prefix it holds."""
        return len(req.route_token_ids()) - self.prefixes.cached_tokens(process_id, req.block_keys(self.prefixes))

    def move(self, now: float, withdraw: Callable[[GatewayRequest], bool]) -> None:
        """Off each prefill worker's queue, ask back (`withdraw`, True once asked) the prompt `prompt_to_move`
        picks, to be prefilled by its decode worker: one per decode worker, and only prompts that can still
        move (not begun, not pinned to a draft's or a session's worker)."""
        if not self.rules.enabled:
            return
        queues: defaultdict[str, dict[str, GatewayRequest]] = defaultdict(dict)  # prefill worker -> prompts there
        for req in self.requests.values():
            if req.awaits_first_token and req.prefill is not None and req.decode is not None:
                queues[req.prefill.process_id][req.internal_id] = req
        taken: set[str] = set()  # decode workers asked to take a prompt this tick

        def seconds_on_decode(req: GatewayRequest, prefill_rate: float, started: set[str]) -> float | None:
            assert req.decode is not None
            decode = self.router.workers.get(req.decode.process_id)
            if decode is None or decode.process_id in taken or req.pinned or req.withdrawing is not None \
                    or req.preferred is not None or req.internal_id in started:
                return None
            return self.seconds_on_decode(req, decode, prefill_rate, now)

        for process_id, queue in queues.items():
            prefill = self.router.workers.get(process_id)
            if prefill is None or prefill.load.prefill_tokens_per_s <= 0.0:
                continue
            rate, account = prefill.load.prefill_tokens_per_s, prefill.load.first_token_work
            started = set(prefill.load.prefilling)
            seconds = first_token_seconds(account, lambda rid, q=queue: rid.startswith(self.ours) and rid not in q,
                                          rate)
            waiting = [(queue[rid], s) for rid, s in seconds.items() if rid in queue]
            # Prompts sent since the account was made (or past its MAX_FORETOLD) come after all it holds.
            tail = max(seconds.values(), default=0.0)
            for rid, req in queue.items():
                if rid not in account:
                    tail += self.uncached_tokens(req, process_id) / rate
                    waiting.append((req, tail))
            req = self.rules.prompt_to_move(waiting, now,
                                            lambda r, rate=rate, started=started: seconds_on_decode(r, rate, started))
            if req is not None and req.decode is not None and withdraw(req):
                taken.add(req.decode.process_id)
