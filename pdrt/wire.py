"""Every message that crosses a process boundary, as msgspec structs.

Two protocols share this module:

* the **client protocol** (client DEALER -> gateway ROUTER): `ClientRequest`
  one way, `ClientReply` the other. A client opens with `Hello`; the gateway
  answers `Ready` when the protocol versions match and `Error` otherwise, and
  answers every later frame from a client that has not said `Hello` with an
  `Error` (code "handshake_required"). Besides one-shot `Generate`, a prompt
  can stream in while it is typed (`DraftOpen`, `DraftAppend`,
  `DraftReplace`, then `DraftSubmit` or `DraftAbandon`). docs/protocol.md
  lays it out.
* the **internal protocol** between gateway, controller and workers
  (`InternalMessage`). Every process registers with the controller, which
  checks its protocol version, so two processes only ever talk after both
  passed that check.

Structs are `array_like` (compact, positional on the wire) and tagged, so one
`msgspec.msgpack.Decoder` per union decodes and validates any frame: a frame
that is not msgpack, names no known tag, or has a field of the wrong type is
rejected whole. KV bytes never travel in these structs: they move by handle
(shared memory) or as separate zero-copy frames (TCP).

Every wire type lives in this one module, on purpose: one decoder per union then validates any
frame, and a reader finds the whole protocol in one place. That is why it is long.
"""

from typing import Any

import msgspec

from pdrt.engine.outputs import RequestOutput
from pdrt.engine.sampling_params import SamplingParams

PROTOCOL_VERSION = 1
MAX_CLIENT_FRAME_BYTES = 8 << 20


def _struct(tag: str) -> dict[str, Any]:
    return dict(tag=tag, array_like=True, omit_defaults=True, forbid_unknown_fields=True)


# -- client protocol --------------------------------------------------------


class ChatMessage(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    role: str
    content: str


class Hello(msgspec.Struct, **_struct("hello")):
    protocol_version: int
    client: str = ""


class Generate(msgspec.Struct, **_struct("generate")):
    """Generate from exactly one of `prompt` (text), `messages` (chat) or `token_ids`.

    `request_id` is chosen by the client and unique among its open requests.
    With `stream`, every batch of new tokens comes as a `Tokens` frame; without
    it, one `Tokens` frame carries everything at the end. `timeout_s` bounds
    the whole request; the gateway's default applies when it is None. A chat
    request with a `session_id` is remembered (its messages and the answer),
    so that a warmup of that session can prefill the conversation so far.
    `continuation` resumes a streamed request whose gateway was lost: the
    tokens it had streamed so far, from which this gateway goes on (with the
    same seed, the output equals an unbroken run's); `continuation_logprobs`
    their log-probabilities, for a request that asked for them.
    """

    request_id: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    token_ids: list[int] | None = None
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = True
    timeout_s: float | None = None
    session_id: str = ""
    continuation: list[int] | None = None
    continuation_logprobs: list[float] | None = None


class Cancel(msgspec.Struct, **_struct("cancel")):
    request_id: str


class GetStatus(msgspec.Struct, **_struct("get_status")):
    pass


class DraftOpen(msgspec.Struct, **_struct("draft_open")):
    """Start a prompt that the user is still typing; the server may prefill its stable part before submit.

    With `messages` (the conversation so far, possibly empty) the typed text
    becomes the next user message under the chat template; with None it is
    a plain prompt. `draft_id` is the client's, unique among its open drafts.
    """

    draft_id: str
    messages: list[ChatMessage] | None = None
    session_id: str = ""
    cache_salt: str = ""  # as `SamplingParams.cache_salt`; the submit's parameters take this one


class DraftAppend(msgspec.Struct, **_struct("draft_append")):
    draft_id: str
    text: str


class DraftReplace(msgspec.Struct, **_struct("draft_replace")):
    """Keep the first `num_kept_chars` characters of the draft and append `text` (edits, backspace)."""

    draft_id: str
    num_kept_chars: int
    text: str = ""


class DraftSubmit(msgspec.Struct, **_struct("draft_submit")):
    """The draft is complete: generate from it as `request_id`, exactly as a `Generate` of its final text would."""

    draft_id: str
    request_id: str
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = True
    timeout_s: float | None = None


class DraftAbandon(msgspec.Struct, **_struct("draft_abandon")):
    draft_id: str


class Warmup(msgspec.Struct, **_struct("warmup")):
    """The user focused the input of `session_id`: the native-protocol twin of the UDP warmup datagram."""

    session_id: str


ClientRequest = (Hello | Generate | Cancel | GetStatus | DraftOpen | DraftAppend | DraftReplace | DraftSubmit
                 | DraftAbandon | Warmup)


class Ready(msgspec.Struct, **_struct("ready")):
    protocol_version: int
    server: str
    model: str
    max_model_len: int


class Usage(msgspec.Struct, array_like=True, omit_defaults=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Tokens(msgspec.Struct, **_struct("tokens")):
    """New output of one request. `finish_reason` is "stop", "length" or "cancelled" on the last frame."""

    request_id: str
    token_ids: list[int]
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    logprobs: list[float] | None = None


class Error(msgspec.Struct, **_struct("error")):
    """A typed failure: `code` is stable (see pdrt.errors), `message` is for people.

    `request_id` is None when the frame that failed could not be read far
    enough to know it. An error with a request id ends that request.
    """

    code: str
    message: str
    request_id: str | None = None


class WorkerStatus(msgspec.Struct, array_like=True, omit_defaults=True):
    process_id: str
    role: str
    alive: bool
    load: "Load"


class Status(msgspec.Struct, **_struct("status")):
    """Workers as the gateway sees them, and the gateway's counters (name -> value)."""

    workers: list[WorkerStatus]
    num_open_requests: int = 0
    counters: dict[str, int] = {}


ClientReply = Ready | Tokens | Error | Status


# -- internal protocol --------------------------------------------------------


class Load(msgspec.Struct, array_like=True, omit_defaults=True):
    """What a worker reports about itself with every heartbeat."""

    num_waiting: int = 0
    num_running: int = 0
    num_held: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_used_blocks: int = 0
    num_waiting_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens_ahead: int = 0  # draft tokens whose KV was ready before their submit, since start
    num_draft_rollbacks: int = 0
    # Over the last steps that decoded (pdrt.metrics.worker_metrics.RECENT_STEPS): their mean latency, and that
    # of those among them that prefilled nothing (0.0 when there were none): what the worker's streams get
    # between two tokens now, and what they would get without the prompts it prefills itself.
    step_s: float = 0.0
    decode_step_s: float = 0.0
    prefill_tokens_per_s: float = 0.0  # prompt tokens per second of the recent steps that prefilled (0.0: none)
    prefill_step_tokens: float = 0.0  # the prompt tokens one of those steps computed, on average
    # A prefill worker's prompts without their first token: request id -> prompt tokens it computes until that
    # one's first token, if no other arrives (pdrt.engine.scheduler.Scheduler.first_token_work); and those of
    # them it has begun, which it can no longer give back (`Withdraw`).
    first_token_work: dict[str, int] = msgspec.field(default_factory=dict)
    prefilling: list[str] = msgspec.field(default_factory=list)
    num_tokens_left: int = 0  # output tokens its sequences may still produce (what their max_tokens leave)


class KVSourceDescriptor(msgspec.Struct, array_like=True, gc=False):
    """Where a prefill worker's KV pool can be read from, and its shape.

    `backend` is a `pdrt.transport.TransferBackend` value; `address` is the
    shared-memory segment's path or the TCP endpoint that serves pulls. An
    "auto" source gives both: the segment in `address`, the endpoint in
    `tcp_address`, and `host_id` says which host's shared memory the segment
    is in (pdrt.transport.auto.local_host_id), so a puller on that host maps
    it and any other pulls over TCP.
    """

    backend: int
    address: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    host_id: str = ""
    tcp_address: str = ""
    ipc_handle: bytes = b""  # a CUDA IPC source's (pdrt.transport.cuda_ipc.CudaHandle, encoded)


class Register(msgspec.Struct, **_struct("register")):
    protocol_version: int
    process_id: str
    incarnation: str
    role: str
    address: str  # the process's inbox (ROUTER) for internal messages


class Registered(msgspec.Struct, **_struct("registered")):
    heartbeat_s: float
    lease_s: float


class Heartbeat(msgspec.Struct, **_struct("heartbeat")):
    process_id: str
    incarnation: str
    load: Load = msgspec.field(default_factory=Load)


class Goodbye(msgspec.Struct, **_struct("goodbye")):
    """A process that shuts down cleanly leaves the registry at once instead of waiting out its lease."""

    process_id: str
    incarnation: str


class WorkerInfo(msgspec.Struct, array_like=True, omit_defaults=True):
    process_id: str
    incarnation: str
    role: str
    address: str
    load: Load


class ClusterView(msgspec.Struct, **_struct("cluster_view")):
    """The live workers, sent to every gateway after each change and periodically. Not `complete` while a
    restarted controller is still learning the cluster: a worker missing from it is not gone."""

    workers: list[WorkerInfo]
    complete: bool = True


class ProcessLost(msgspec.Struct, **_struct("process_lost")):
    """The controller declared this incarnation dead (lease missed, exited or replaced): its inbox `address`,
    and whether its supervisor saw it `exited` (a frozen one may wake). Gateways hear of every lost worker;
    workers hear of every lost process: a lost gateway's requests are dropped, and the KV handed to a decode
    worker that exited is freed."""

    process_id: str
    incarnation: str
    address: str = ""
    exited: bool = False


class ProcessExited(msgspec.Struct, **_struct("process_exited")):
    """Supervisor -> controller: a child of it exited. Its parent knows at once; the lease would take seconds."""

    process_id: str
    incarnation: str


class ChangeRole(msgspec.Struct, **_struct("change_role")):
    """Controller -> a worker of a disaggregated node, through its link: serve as `role` ("prefill" or "decode")
    from now on; gateways already route to it as that. `reason` is the decision's, for the worker's log."""

    role: str
    reason: str = ""


class RoleChanged(msgspec.Struct, **_struct("role_changed")):
    """Worker -> controller: it serves as `role` now, having sent `moved` streams of its old role elsewhere."""

    process_id: str
    incarnation: str
    role: str
    moved: int = 0


class ShedStreams(msgspec.Struct, **_struct("shed_streams")):
    """Controller -> a decode worker with more streams than another decode worker: send `count` of them on, as
    continuations its gateways route to the decode worker with the fewest. `reason` is for the worker's log."""

    count: int
    reason: str = ""


class SetRole(msgspec.Struct, **_struct("set_role")):
    """A holder of the cluster key (an operator's tool) -> controller: make `process_id` serve as `role`. The
    controller answers `Error` (code "invalid_request") when it cannot, else `RoleChanged` once it is done."""

    process_id: str
    role: str


class PrefillRequest(msgspec.Struct, **_struct("prefill")):
    """Gateway -> prefill (or colocated) worker. `decode_address` is empty for a colocated worker; `decode_id`
    names the decode worker, the only one that may pull the request's KV. A continuation (a stream moved off
    a worker that died) ends its `token_ids` with its `num_prior_outputs` outputs so far."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    reply_to: str  # the gateway's inbox
    decode_address: str = ""
    decode_id: str = ""
    num_prior_outputs: int = 0


class DraftUpdate(msgspec.Struct, **_struct("draft_update")):
    """Gateway -> prefill (or colocated) worker: the draft keeps `num_kept` tokens and gains `token_ids`.

    The first update of a draft creates it, with the prefix cache of
    `cache_salt` (its submit's parameters carry the same). `colocated` drafts
    decode where they were prefilled once submitted.
    """

    draft_id: str
    num_kept: int
    token_ids: list[int]
    colocated: bool = False
    cache_salt: str = ""


class DraftSubmitted(msgspec.Struct, **_struct("draft_submitted")):
    """Gateway -> worker: the draft's final tokens (all of them) and parameters; from here on it is a request.

    The whole prompt travels, not a delta, so a worker that lost the draft
    (expired, or restarted) still serves the request from scratch.
    """

    draft_id: str
    token_ids: list[int]
    params: SamplingParams
    reply_to: str
    decode_address: str = ""
    decode_id: str = ""


class KVHandoff(msgspec.Struct, **_struct("kv_handoff")):
    """Prefill -> decode: the prompt KV is ready to pull; decode continues after `first_token`.

    `lease_expires_at` is the prefill host's `time.monotonic()` after which
    the blocks may be reused; a pull must have completed before it.
    """

    request_id: str
    token_ids: list[int]
    first_token: int
    params: SamplingParams
    reply_to: str  # the gateway's inbox
    prefill_address: str
    source: KVSourceDescriptor
    block_ids: list[int]
    lease_expires_at: float
    first_logprob: float | None = None  # with `params.logprobs`: the first token's, which decode reports on
    num_prior_outputs: int = 0  # a continuation's (PrefillRequest)


class KVAck(msgspec.Struct, **_struct("kv_ack")):
    """Decode -> prefill: the blocks of `request_id` are no longer needed (pulled, or given up)."""

    request_id: str


class Abort(msgspec.Struct, **_struct("abort")):
    request_id: str


class Withdraw(msgspec.Struct, **_struct("withdraw")):
    """Gateway -> prefill worker: give `request_id` back if it still waits to start, to be prefilled elsewhere."""

    request_id: str
    reply_to: str


class GatewayBack(msgspec.Struct, **_struct("gateway_back")):
    """Gateway -> worker, before anything else it sends that worker, and again when it thaws after it was
    declared lost: its inbox at `address` is a live gateway's, whose requests from here on are new (a worker
    drops those of a lost gateway's inbox, which a restarted gateway may bind again)."""

    address: str


class Withdrawn(msgspec.Struct, **_struct("withdrawn")):
    """Prefill worker -> gateway: `withdrawn` when the request was dropped there unstarted, else it stays."""

    request_id: str
    withdrawn: bool
    process_id: str  # the prefill worker's


class StepOutputs(msgspec.Struct, **_struct("step_outputs")):
    """Worker -> gateway: everything one engine step produced, in one message."""

    process_id: str
    outputs: list[RequestOutput]


class RequestFailed(msgspec.Struct, **_struct("request_failed")):
    """Worker -> gateway: a request ended in error on this worker. `retryable` when no token was produced."""

    request_id: str
    code: str
    message: str
    retryable: bool = False
    process_id: str = ""  # the worker's; a gateway takes a failure only from a worker of the request


class MetricsReport(msgspec.Struct, **_struct("metrics_report")):
    """Any process -> controller, every second: its metrics as Prometheus text, unlabelled (pdrt.metrics)."""

    process_id: str
    incarnation: str
    role: str
    exposition: bytes


class MetricsView(msgspec.Struct, **_struct("metrics_view")):
    """Controller -> gateways, at most once a second: every process's metrics merged, labelled with process and role."""

    exposition: bytes


InternalMessage = (Register | Registered | Heartbeat | Goodbye | ClusterView | ProcessLost | ProcessExited
                   | ChangeRole | RoleChanged | ShedStreams | SetRole | PrefillRequest | DraftUpdate | DraftSubmitted
                   | KVHandoff | KVAck | Abort | Withdraw | Withdrawn | GatewayBack
                   | StepOutputs | RequestFailed | Error | MetricsReport | MetricsView)

client_request_decoder = msgspec.msgpack.Decoder(ClientRequest)
client_reply_decoder = msgspec.msgpack.Decoder(ClientReply)
internal_decoder = msgspec.msgpack.Decoder(InternalMessage)
encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return encoder.encode(message)


# -- KV transfer over TCP -----------------------------------------------------
#
# A decode worker's DEALER asks a prefill worker's ROUTER for blocks with
# `KVPullRequest`; the answer is `KVPullReply` alone when refused, or
# `KVPullReply` followed by one frame holding the blocks' bytes, in the
# order asked, as a `[layers, 2, len(block_ids), block_size, kv_heads, head_dim]`
# tensor. These two never mix with `InternalMessage`: they travel on the
# source's own socket.


class KVPullRequest(msgspec.Struct, **_struct("kv_pull")):
    """`seq` numbers one puller's requests, so a late reply to a timed-out request is never taken for a newer one."""

    seq: int
    request_id: str
    block_ids: list[int]


class KVPullReply(msgspec.Struct, **_struct("kv_pull_reply")):
    """`error` is empty on success, and `num_bytes` is then the size of the data frame that follows."""

    seq: int
    num_bytes: int = 0
    error: str = ""
    message: str = ""


kv_pull_request_decoder = msgspec.msgpack.Decoder(KVPullRequest)
kv_pull_reply_decoder = msgspec.msgpack.Decoder(KVPullReply)
