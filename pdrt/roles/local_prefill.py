"""Conditional disaggregation's rules: when a decode worker should prefill a prompt itself.

The gateway asks twice. When a prompt arrives (`may_prefill_on_decode`), a
short one behind a backlog goes to its decode worker if that worker's recent
steps leave room (and, in the gateway, if its stall passes `stall_fits` as a
move's must). While prompts wait (`prompt_to_move`, every gateway tick),
when the prefill worker's own account of its queue says some will miss the
TTFT SLO, the one whose move leaves the fewest late moves to its decode
worker, if the stall keeps every stream decoding there within its TPOT bound
(`stall_fits`, `tpot_bound`): a burst of prompts builds the queue after they
arrived, where the first rule cannot see.
"""

from collections.abc import Callable, Iterable

from pdrt.node_config import GatewayConfig
from pdrt.roles.gateway_request import GatewayRequest
from pdrt.wire import Load


def may_prefill_on_decode(config: GatewayConfig, num_prompt_tokens: int, backlog_tokens: int, decode: Load) -> bool:
    """Whether a prompt should be prefilled by its decode worker rather than queue behind `backlog_tokens`.

    Only a prompt of at most `local_prefill_max_tokens`, behind a backlog of
    at least `local_prefill_queue_tokens`. And only while the decode worker
    has room for the stall in its streams' time between tokens: when it runs
    no sequence, or when its recent steps, stalls included, average under the
    TPOT SLO and under `local_prefill_max_slowdown` times its plain decode
    steps. Each local prefill lengthens that average, so the decode worker
    takes the next one only once its streams are back within the bound.
    """
    if not 0 < num_prompt_tokens <= config.local_prefill_max_tokens:
        return False
    if backlog_tokens < config.local_prefill_queue_tokens:
        return False
    if decode.num_running == 0:
        return True
    if decode.decode_step_s <= 0.0:
        return False  # every recent step stalled for a prefill
    return decode.step_s < min(config.tpot_slo_s, config.local_prefill_max_slowdown * decode.decode_step_s)


# Of the slack `local_prefill_max_slowdown` leaves a stream over its plain steps, what local prefills may spend
# over the stream's life: with all of it, the Zen 4 host's chat TPOT p99 under long prompts read 1.24x and 1.41x
# its p99 alone (docs/benchmarks.md), where each stream's mean was within 1.25x.
LIFE_SLACK_SHARE = 0.5


def tpot_bound(config: GatewayConfig, decode: Load) -> float:
    """What a stream on `decode` may average between its tokens over its life, stalls included: under the TPOT SLO
    and under its plain decode steps plus LIFE_SLACK_SHARE of what `local_prefill_max_slowdown` allows over them
    (0.0 while those are unknown).

    The slowdown bound is the isolation disaggregation exists for: bounding
    moves by the TPOT SLO alone raised the Zen 4 host's interference measure
    from 1.07 to 1.46 and bought no goodput that moves within this bound did
    not (docs/benchmarks.md)."""
    if decode.decode_step_s <= 0.0:
        return 0.0
    slowdown = 1.0 + LIFE_SLACK_SHARE * (config.local_prefill_max_slowdown - 1.0)
    return min(config.tpot_slo_s, slowdown * decode.decode_step_s)


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


def prompt_to_move(queue: list[tuple[GatewayRequest, float]], ttft_slo_s: float, now: float,
                   seconds_elsewhere: Callable[[GatewayRequest], float | None]) -> GatewayRequest | None:
    """The prompt whose move to its decode worker leaves the fewest of a prefill worker's prompts late, if fewer
    than stay late without a move.

    `queue` holds the worker's waiting prompts, each with the seconds until
    its first token there, in the order the worker serves them. A move takes
    the prompt's own seconds off every prompt after it; on its decode worker
    it gets its first token after `seconds_elsewhere` (None: it cannot go).
    Of moves that leave as many late, the last prompt's goes: it is the
    least likely to have started by the time the worker is asked (its
    account is a heartbeat old).
    """
    def late(req: GatewayRequest, seconds: float) -> bool:
        return now - req.admitted_at + seconds > ttft_slo_s

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
