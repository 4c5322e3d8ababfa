"""One node's deployment: which processes run, where they listen, and how each engine is sized.

Read from TOML (`pdrt up --config node.toml`), then overridden by environment
variables and then by command-line flags. Every table and key is optional:

    model = "/models/SmolLM2-135M-Instruct"   # default: the model `pdrt model fetch` installs
    host = "127.0.0.1"                        # where every socket of this node binds (an address peers reach)
    node = ""                                 # this node's name, in its workers' names: "decode-b-0"
    mode = "disaggregated"                    # or "colocated"
    transfer = "auto"                         # KV handoff: "auto" (shm where the decode worker shares the
                                              # host, else tcp), "shm" (same host only) or "tcp"
    cluster_key = ""                          # authenticates the internal plane (`pdrt key` makes one);
                                              # `pdrt up` makes one per run when empty; every node of a
                                              # cluster needs the same (better: PDRT_CLUSTER_KEY)

    [gateway]
    port = 7100
    enabled = true                            # false: no gateway on this node
    ttft_slo_s = 1.0                          # the SLOs that goodput (and ETOP) count against
    tpot_slo_s = 0.1
    local_prefill_max_tokens = 512            # a prompt this short may be prefilled on its decode worker
    local_prefill_queue_tokens = 512          # while the prefill worker has this many tokens waiting,
    local_prefill_max_slowdown = 1.25         # and the decode worker's recent steps, stalls included, take at
                                              # most this many times its plain decode steps (and < tpot_slo_s);
                                              # later, waiting prompts move there to save their TTFT SLO

    [warmup]                                  # UDP warmup channel, off without a key
    port = 7102
    key = "a long random secret"

    [controller]
    port = 7101
    host = ""                                 # where the controller is reached (default: `host`)
    enabled = true                            # false: the controller runs on another node
    metrics_port = 7103                       # Prometheus metrics of the whole node over HTTP; 0: off

    [engine]                                  # every worker's engine
    kv_cache_bytes = 1073741824
    max_prefill_chunk_size = 512

    [prefill]                                 # [decode] and [colocated] alike
    count = 1
    threads = 1
    nice = 10                                 # CPU priority of the process (0 for decode and colocated):
                                              # on shared cores, decode steps and the gateway go first
    catch_up_below_params = 10_000_000        # with a model smaller than this, the prefill worker yields
    catch_up_wait = 0.25                      # only until a prompt has waited this fraction of ttft_slo_s
                                              # to start, then runs at the niceness it was started with
    prompt_batch_tokens = 64                  # prompts one by one, short whole ones batched within this
                                              # many tokens (default: 64 on the CPU, side by side on a GPU)
    prompt_order = "ratio"                    # or "deadline": the fewest first tokens past ttft_slo_s

    [decode]
    own_cores = false                         # true: on the CPU (disaggregated), each decode worker
                                              # runs on `threads` cores of its own, the node's other
                                              # processes on the rest (pdrt/cpu_placement.py)
    borrow_threads = true                     # on the CPU, each decode step also runs on the threads
                                              # of this run's prefill workers that are idle then
    borrow_min_params = 10_000_000            # models smaller than this never borrow

The supervisor hands the resolved config to its children as JSON.

Several nodes make one cluster: one node runs the controller (and the
gateway), the others set `[controller] host` to that node's address,
`enabled = false` for the controller and the gateway, counts of 0 for the
roles they do not run, and a `node` name that keeps their workers' names
apart in the controller's registry. docs/deploy.md has a two-node example.
"""

import os
import re
import tomllib
from pathlib import Path

import msgspec

from pdrt.actors.cluster_key import ClusterKey
from pdrt.engine.config import DEFAULT_KV_CACHE_BYTES, DEFAULT_PREFILL_CHUNK, EngineConfig
from pdrt.errors import ConfigError

MODES = ("disaggregated", "colocated")
TRANSFERS = ("shm", "tcp", "auto")
WORKER_ROLES = ("prefill", "decode", "colocated")
# On one Xeon core a SmolLM2-135M prefill step of 64 tokens takes 157 ms, one of 512 1039 ms (about 31 ms
# fixed, 2 ms a token): short prompts joining a step save its fixed time and delay its first prompt <= 0.13 s.
CPU_PROMPT_BATCH = 64
_NODE_NAME = re.compile(r"[A-Za-z0-9_]{1,32}")


class _Table(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class GatewayConfig(_Table):
    port: int = 7100
    enabled: bool = True
    max_open_requests: int = 1024
    max_drafts: int = 1024
    request_timeout_s: float = 600.0
    drain_timeout_s: float = 10.0
    ttft_slo_s: float = 1.0  # a request meets its SLOs with its first token within this many seconds
    tpot_slo_s: float = 0.1  # and this many seconds per later token (pdrt.metrics.gateway_metrics)
    http_port: int = 7180  # the OpenAI-compatible HTTP front and the demo page; 0 turns it off
    api_key: str = ""  # when set, HTTP /v1/ routes need `Authorization: Bearer <key>` (or PDRT_API_KEY)
    # Conditional disaggregation (pdrt/roles/local_prefill.py): a prompt of at most local_prefill_max_tokens
    # (0: none, and no moves either) is prefilled by its decode worker itself while the prefill workers have at
    # least local_prefill_queue_tokens of prompts waiting, one such prompt per decode worker at a time, and only
    # while that worker's recent steps, its stalls for such prompts included, average under tpot_slo_s and
    # under local_prefill_max_slowdown times its steps that only decode: the stall is paid by the requests
    # decoding there, and disaggregation exists to bound it. Later, a waiting prompt of any length moves to its
    # decode worker when that leaves fewer prompts past ttft_slo_s, if every stream there stays within half the
    # slowdown's slack over its life (arrivals too).
    local_prefill_max_tokens: int = 512
    local_prefill_queue_tokens: int = 512
    local_prefill_max_slowdown: float = 1.25


class WarmupConfig(_Table):
    """The UDP warmup channel; it is off while `key` is empty (set it, or PDRT_WARMUP_KEY)."""

    port: int = 7102
    key: str = ""
    ttl_s: float = 10.0  # how long a warmup holds its prefill
    max_reservations: int = 64
    max_age_s: float = 5.0  # older datagrams are stale


class ControllerConfig(_Table):
    port: int = 7101
    host: str = ""  # where the controller is reached; on the controller's own node it also binds there
    enabled: bool = True
    heartbeat_s: float = 0.25
    lease_s: float = 2.0
    metrics_port: int = 7103  # HTTP: Prometheus text of every process, merged; 0 turns it off


class EngineSettings(_Table):
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    block_size: int = 16
    max_prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    hash_seed: int = 0
    dtype: str = "auto"
    device: str = "cpu"
    kv_lease_s: float = 30.0  # how long a prefill worker holds handed-off KV without an acknowledgement
    min_draft_chunk: int = 128  # type-ahead: start prefilling a draft once this many stable tokens wait
    min_draft_step: int = 16  # then whenever this many more do
    max_draft_tokens: int | None = None  # per draft (default: the context length)
    max_draft_pool_fraction: float = 0.5  # of the KV pool, for all drafts together
    draft_ttl_s: float = 60.0  # a draft without updates for this long is dropped


class WorkerGroup(_Table):
    count: int = 1
    threads: int | None = None  # default: the cores split evenly across workers
    nice: int = 0  # the worker process's niceness (-20..19; below 0 needs CAP_SYS_NICE)


class PrefillGroup(WorkerGroup):
    # Where prefill shares cores with decode workers, the gateway and clients (a CPU host, or a GPU host's
    # few cores), a prompt's seconds of arithmetic must not delay a decode step or a token on its way out:
    # the scheduler gives a runnable process of niceness 0 about ten times the CPU of one at 10.
    nice: int = 10
    # A smaller model's prompt takes milliseconds while its decode steps, bound by Python, keep a core busy:
    # at nice 10 throughout, the prefill worker got what the decode worker, gateway and clients left, and TTFT
    # broke first (the tiny test model's disaggregated goodput: 24 and 42 req/s at nice 10, 55 and 47 at 0);
    # at nice 0 throughout, long prompts doubled the decode steps' TPOT p99. So it yields only while every
    # prompt starts within catch_up_wait x [gateway] ttft_slo_s (pdrt/priority.py, CatchUp).
    catch_up_below_params: int = 10_000_000
    catch_up_wait: float = 0.25
    # Prompts one by one, highest response ratio first (pdrt/engine/scheduler.py, which says why): a step holds
    # one prompt, plus whole ones while it stays within this many tokens. None: CPU_PROMPT_BATCH on the CPU; on
    # a GPU, where a step's time grows little with its tokens, prompts batch side by side.
    prompt_batch_tokens: int | None = None
    # The order of prompts one by one: "ratio", highest response ratio first; or "deadline", the order that
    # leaves the fewest past [gateway] ttft_slo_s at the worker's recent prefill rate, the late ones last until
    # overdue. Measured with SmolLM2 on two cores (docs/benchmarks.md, 2026-12-05 night), "deadline" met the
    # TTFT SLO more often past the goodput rate (80% against 56-66% at 1.03 req/s), not at it (91% against
    # 77-94% at 0.868), and its decode streams' TPOT p99 under long prompts read 83-88 ms against 62-67.
    # It needs prompts one by one: on a GPU, with prompt_batch_tokens set.
    prompt_order: str = "ratio"


class DecodeGroup(WorkerGroup):
    # A decode worker under load steps without pause, and a core shared with prefill, the gateway and clients
    # stretches its steps; but on a host of few cores, the rest is too small for prefill and the gateway
    # together (pdrt/cpu_placement.py has the numbers), so it is not the default.
    own_cores: bool = False
    borrow_threads: bool = True  # pdrt/roles/thread_ledger.py
    # A smaller model's step is bound by Python, not arithmetic: a second thread only adds OpenMP's wake-ups
    # and spinning on the core that prefill, the gateway and clients need (measured with the tiny test model
    # at 10.5 req/s: TPOT p90 36 ms borrowing, 14 ms not).
    borrow_min_params: int = 10_000_000


def role_of(process: str) -> str:
    """The role of a process name of `NodeConfig.process_names` ("decode-b-0" -> "decode")."""
    return process.split("-", 1)[0]


class NodeConfig(_Table):
    model: str = ""
    host: str = "127.0.0.1"
    node: str = ""
    mode: str = "disaggregated"
    transfer: str = "auto"
    cluster_key: str = ""  # pdrt/actors/cluster_key.py; `pdrt up` makes one per run when empty
    gateway: GatewayConfig = msgspec.field(default_factory=GatewayConfig)
    controller: ControllerConfig = msgspec.field(default_factory=ControllerConfig)
    warmup: WarmupConfig = msgspec.field(default_factory=WarmupConfig)
    engine: EngineSettings = msgspec.field(default_factory=EngineSettings)
    prefill: PrefillGroup = msgspec.field(default_factory=PrefillGroup)
    decode: DecodeGroup = msgspec.field(default_factory=DecodeGroup)
    colocated: WorkerGroup = msgspec.field(default_factory=WorkerGroup)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.transfer not in TRANSFERS:
            raise ConfigError(f"transfer must be one of {', '.join(TRANSFERS)}, got {self.transfer!r}")
        ClusterKey.parse(self.cluster_key)  # raises ConfigError for a malformed key
        for name in WORKER_ROLES:
            if getattr(self, name).count < 0:
                raise ConfigError(f"[{name}] count must be >= 0")
            if not -20 <= getattr(self, name).nice <= 19:
                raise ConfigError(f"[{name}] nice must be in -20..19, got {getattr(self, name).nice}")
        for name, port in (("gateway", self.gateway.port), ("controller", self.controller.port)):
            if not (0 < port < 65536):
                raise ConfigError(f"[{name}] port must be in 1..65535, got {port}")
        if self.controller.lease_s <= self.controller.heartbeat_s:
            raise ConfigError("[controller] lease_s must be longer than heartbeat_s")
        if self.node and not _NODE_NAME.fullmatch(self.node):
            raise ConfigError(f"node must be 1-32 letters, digits or '_', got {self.node!r}")
        if not self.process_names():
            raise ConfigError("this node runs no process: enable the controller or the gateway, or give a worker "
                              "count")
        if not 0 < self.prefill.catch_up_wait <= 1:
            raise ConfigError(f"[prefill] catch_up_wait must be in (0, 1], got {self.prefill.catch_up_wait}")
        if self.prefill.prompt_order not in ("ratio", "deadline"):
            raise ConfigError(f"[prefill] prompt_order must be ratio or deadline, got {self.prefill.prompt_order!r}")
        if self.prefill.prompt_batch_tokens is not None and self.prefill.prompt_batch_tokens < 0:
            raise ConfigError(f"[prefill] prompt_batch_tokens must be >= 0, got {self.prefill.prompt_batch_tokens}")
        if self.prefill.prompt_order == "deadline" and self._prompt_batch_tokens("prefill") is None:
            raise ConfigError('[prefill] prompt_order = "deadline" orders prompts taken one by one, and on a GPU '
                              "they batch side by side: set [prefill] prompt_batch_tokens too")
        if self.gateway.local_prefill_max_tokens < 0 or self.gateway.local_prefill_queue_tokens < 0:
            raise ConfigError("[gateway] local_prefill_max_tokens and local_prefill_queue_tokens must be >= 0")
        if not self.gateway.local_prefill_max_slowdown >= 1.0:
            raise ConfigError(f"[gateway] local_prefill_max_slowdown must be >= 1, got "
                              f"{self.gateway.local_prefill_max_slowdown}")
        if not (0 <= self.controller.metrics_port < 65536):
            raise ConfigError(f"[controller] metrics_port must be in 0..65535, got {self.controller.metrics_port}")

    # -- addresses ------------------------------------------------------------

    @property
    def gateway_address(self) -> str:
        return f"tcp://{self.host}:{self.gateway.port}"

    @property
    def controller_address(self) -> str:
        return f"tcp://{self.controller.host or self.host}:{self.controller.port}"

    @property
    def key(self) -> ClusterKey | None:
        """The cluster key of the internal plane; None: plain sockets (processes started outside `pdrt up`)."""
        return ClusterKey.parse(self.cluster_key)

    def ephemeral_address(self) -> str:
        """Where a process binds a socket whose port others learn from the controller."""
        return f"tcp://{self.host}:*"

    # -- processes ------------------------------------------------------------

    def worker_counts(self) -> dict[str, int]:
        if self.mode == "colocated":
            return {"colocated": self.colocated.count}
        return {"prefill": self.prefill.count, "decode": self.decode.count}

    def process_names(self) -> list[str]:
        """Every process of the node, in start order: controller, workers, gateway (those enabled here).

        Workers carry the node's name, when it has one, so that the workers
        of several nodes register with one controller under distinct names.
        """
        names = ["controller"] if self.controller.enabled else []
        infix = f"{self.node}-" if self.node else ""
        for role, count in self.worker_counts().items():
            names += [f"{role}-{infix}{i}" for i in range(count)]
        return names + (["gateway"] if self.gateway.enabled else [])

    def threads_for(self, role: str) -> int:
        explicit = getattr(self, role).threads
        if explicit is not None:
            return explicit
        num_workers = max(1, sum(self.worker_counts().values()))
        return max(1, (os.cpu_count() or 1) // num_workers)

    def engine_config(self, role: str) -> EngineConfig:
        e = self.engine
        return EngineConfig(model=self.model, device=e.device, dtype=e.dtype, block_size=e.block_size,
                            kv_cache_memory_bytes=e.kv_cache_bytes, max_model_len=e.max_model_len,
                            max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                            max_prefill_chunk_size=e.max_prefill_chunk_size, hash_seed=e.hash_seed,
                            prompt_batch_tokens=self._prompt_batch_tokens(role),
                            num_threads=self.threads_for(role), min_draft_chunk=e.min_draft_chunk,
                            min_draft_step=e.min_draft_step,
                            max_draft_tokens=e.max_draft_tokens, max_draft_pool_fraction=e.max_draft_pool_fraction)

    def _prompt_batch_tokens(self, role: str) -> int | None:
        if role != "prefill":
            return None
        if self.prefill.prompt_batch_tokens is not None:
            return self.prefill.prompt_batch_tokens
        return CPU_PROMPT_BATCH if self.engine.device == "cpu" else None

    # -- (de)serialization ------------------------------------------------------

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes) -> "NodeConfig":
        return _convert(msgspec.json.decode(data), "the node config JSON")


def _convert(raw: dict, source: str) -> NodeConfig:
    try:
        return msgspec.convert(raw, NodeConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from None


# Environment variables and the setting each overrides.
ENVIRONMENT = {
    "PDRT_MODEL": ("model",),
    "PDRT_HOST": ("host",),
    "PDRT_MODE": ("mode",),
    "PDRT_NODE": ("node",),
    "PDRT_CONTROLLER_HOST": ("controller", "host"),
    "PDRT_TRANSFER": ("transfer",),
    "PDRT_PORT": ("gateway", "port"),
    "PDRT_CONTROLLER_PORT": ("controller", "port"),
    "PDRT_KV_CACHE_BYTES": ("engine", "kv_cache_bytes"),
    "PDRT_PREFILL_CHUNK": ("engine", "max_prefill_chunk_size"),
    "PDRT_WARMUP_KEY": ("warmup", "key"),
    "PDRT_WARMUP_PORT": ("warmup", "port"),
    "PDRT_HTTP_PORT": ("gateway", "http_port"),
    "PDRT_API_KEY": ("gateway", "api_key"),
    "PDRT_CLUSTER_KEY": ("cluster_key",),
}


# Secrets a process also takes from its own environment when it starts (systemd passes them with
# EnvironmentFile=), so that they need not be written into the config JSON it reads.
SECRET_ENVIRONMENT = ("PDRT_WARMUP_KEY", "PDRT_API_KEY", "PDRT_CLUSTER_KEY")


def with_secrets(config: NodeConfig, environ: dict[str, str] | None = None) -> NodeConfig:
    """`config` with the SECRET_ENVIRONMENT values that `environ` sets (non-empty) in place of its own."""
    environ = os.environ if environ is None else environ
    found = {name: environ[name] for name in SECRET_ENVIRONMENT if name in ENVIRONMENT and environ.get(name)}
    if not found:
        return config
    raw = msgspec.to_builtins(config)
    for name, value in found.items():
        _set(raw, ENVIRONMENT[name], value)
    return _convert(raw, "the node config with secrets from the environment")


def _set(raw: dict, path: tuple[str, ...], value: object) -> None:
    for key in path[:-1]:
        raw = raw.setdefault(key, {})
    raw[path[-1]] = value


def load_node_config(path: str | None = None, overrides: dict[tuple[str, ...], object] | None = None,
                     environ: dict[str, str] | None = None) -> NodeConfig:
    """File, then environment, then `overrides` (from flags; None values are skipped)."""
    raw: dict = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from None
    environ = os.environ if environ is None else environ
    for name, key in ENVIRONMENT.items():
        if name in environ:
            value: object = environ[name]
            if key[-1] in ("port", "http_port", "kv_cache_bytes", "max_prefill_chunk_size"):
                try:
                    value = int(str(value))
                except ValueError:
                    raise ConfigError(f"{name} must be an integer, got {value!r}") from None
            _set(raw, key, value)
    for key, value in (overrides or {}).items():
        if value is not None:
            _set(raw, key, value)
    config = _convert(raw, path or "the node config")
    if not config.model:
        from pdrt.models.fetch import default_model_dir, is_fetched

        if not is_fetched():
            raise ConfigError("no model given and the default model is not fetched; run `pdrt model fetch`")
        config.model = str(default_model_dir())
    return config
