"""The conditional-disaggregation policy applied to a gateway's open requests, constructed directly: which prompt its
decode worker prefills itself, and which waiting prompt moves there."""

from pdrt.engine.sampling_params import SamplingParams
from pdrt.roles.gateway_request import GatewayRequest
from pdrt.roles.local_prefill import LocalPrefill, LocalPrefillRules
from pdrt.roles.prefix_memory import PrefixMemory
from pdrt.roles.router import Router
from pdrt.wire import Load, WorkerInfo

RULES = LocalPrefillRules(max_tokens=512, queue_tokens=512, max_slowdown=1.25, ttft_slo_s=1.0, tpot_slo_s=0.2)


def worker(process_id: str, role: str, **load) -> WorkerInfo:
    return WorkerInfo(process_id, "i1", role, f"tcp://127.0.0.1:1/{process_id}", Load(**load))


def request(rid: str, num_tokens: int, prefill: WorkerInfo | None, decode: WorkerInfo | None,
            admitted_at: float = 0.0) -> GatewayRequest:
    req = GatewayRequest.create(b"c", rid, list(range(3, 3 + num_tokens)), SamplingParams(max_tokens=50), True, 1e9,
                                None)
    req.internal_id, req.prefill, req.decode, req.admitted_at = f"gw-{rid}", prefill, decode, admitted_at
    return req


def policy(*workers: WorkerInfo, requests: list[GatewayRequest]) -> LocalPrefill:
    router = Router()
    router.update(list(workers))
    return LocalPrefill(RULES, router, PrefixMemory(16, 0), {r.internal_id: r for r in requests}, "gw")


def test_a_short_prompt_behind_a_backlog_is_prefilled_on_an_idle_decode_worker_one_at_a_time():
    prefill, decode = worker("prefill-0", "prefill"), worker("decode-0", "decode")
    backlog = [request(f"b{i}", 300, prefill, decode) for i in range(2)]  # 600 tokens waiting there
    short = request("short", 100, None, None)
    assert policy(prefill, decode, requests=backlog).on_decode(short, prefill, decode, now=0.0)
    assert not policy(prefill, decode, requests=backlog[:1]).on_decode(short, prefill, decode, now=0.0)  # 300 < 512
    running_there = request("local", 50, decode, None)  # a local prefill without its first token yet
    assert not policy(prefill, decode, requests=[*backlog, running_there]).on_decode(short, prefill, decode, now=0.0)


def test_a_prompt_that_the_prefill_queue_would_make_late_moves_to_its_decode_worker():
    prefill = worker("prefill-0", "prefill", prefill_tokens_per_s=1000.0, first_token_work={"gw-a": 100, "gw-b": 200})
    decode = worker("decode-0", "decode", prefill_tokens_per_s=1000.0, decode_step_s=0.05, step_s=0.05)
    a, b = (request(rid, 100, prefill, decode, admitted_at=9.15) for rid in ("a", "b"))
    asked: list[str] = []
    # At 10.0 a's first token comes 0.95 s after it came, b's 1.05 s: late. On the decode worker b's would come
    # at 0.95 s, and a's moving would bring b's to 0.95 s too: equal moves, the later prompt's goes.
    policy(prefill, decode, requests=[a, b]).move(10.0, lambda req: asked.append(req.request_id) or True)
    assert asked == ["b"]
    asked.clear()
    a.admitted_at = b.admitted_at = 9.5  # both on time: nothing moves
    policy(prefill, decode, requests=[a, b]).move(10.0, lambda req: asked.append(req.request_id) or True)
    assert asked == []
    a.admitted_at = b.admitted_at = 9.15
    b.pinned = True  # its prefill worker holds its draft: it stays, and a's move saves it
    policy(prefill, decode, requests=[a, b]).move(10.0, lambda req: asked.append(req.request_id) or True)
    assert asked == ["a"]
