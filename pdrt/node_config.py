"""One node's deployment: which processes run, where they listen, and how much memory each engine gets.

Read from TOML (`pdrt up --config node.toml`), then overridden by environment
variables and then by command-line flags. Every table and key is optional;
docs/configuration.md lists them all, with their defaults and why.

    model = "/models/SmolLM2-135M-Instruct"   # default: the model `pdrt model fetch` installs
    host = "127.0.0.1"                        # where every socket of this node binds (an address peers reach)
    node = ""                                 # this node's name, in its workers' names: "decode-b-0"
    mode = "auto"                             # "disaggregated" or "colocated"; auto: from a profile or the hardware
    transfer = "auto"                         # KV handoff: "auto", "shm" (same host only) or "tcp"
    cluster_key = ""                          # the internal plane's key (better: PDRT_CLUSTER_KEY)

    [gateway]
    port = 7100                               # native protocol (ZeroMQ)
    http_port = 7180                          # OpenAI API and the demo page; 0: off
    api_key = ""                              # HTTP /v1/ needs it when set (better: PDRT_API_KEY)
    api_keys = {}                             # more keys, each a tenant: {name = "key"} (better: PDRT_API_KEYS)
    enabled = true                            # false: no gateway on this node
    max_open_requests = 1024
    ttft_slo_s = 1.0                          # the SLOs that goodput counts against
    tpot_slo_s = 0.1

    [warmup]                                  # UDP warmup channel, off without a key
    port = 7102
    key = ""                                  # better: PDRT_WARMUP_KEY

    [controller]
    port = 7101
    host = ""                                 # where the controller is reached (default: `host`)
    enabled = true                            # false: the controller runs on another node
    metrics_port = 7103                       # Prometheus metrics of the whole node over HTTP; 0: off
    balance = true                            # move workers between prefill and decode as the load changes
    balance_interval_s = 30.0

    [engine]                                  # every worker's engine
    kv_cache_bytes = 0                        # KV pool per worker; 0: 1 GiB on the CPU, what a GPU's memory leaves
    max_prefill_chunk_size = 512
    max_model_len = 0                         # 0: the model's context
    device = "auto"                           # or cpu, cuda, cuda:N
    gpus = ""                                 # GPUs the workers take one each in turn; "": every one
    gpu_memory_utilization = 0.9
    dtype = "auto"
    speculate = "prompt_lookup"               # speculative decoding; "off", or a draft model's checkpoint

    [prefill]                                 # [decode] and [colocated] alike
    count = 1

    [experimental]                            # tuning for benchmarks and tests; may change without notice

How the workers share the machine (CPU priority, threads, cores, how prompts
are batched) is derived from the device and the model at start-up, and
logged (pdrt/worker_profile.py); `[experimental]` overrides it.

The supervisor hands the resolved config to its children as JSON.

Several nodes make one cluster: one node runs the controller (and the
gateway), the others set `[controller] host` to that node's address,
`enabled = false` for the controller and the gateway, counts of 0 for the
roles they do not run, and a `node` name that keeps their workers' names
apart in the controller's registry. docs/deploy.md has a two-node example.

The whole schema is in this module, each setting documented where it is declared: that is why it
is long.
"""

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from pdrt.actors.cluster_key import ClusterKey
from pdrt.devices import GPU_SHARING_ENV, resolve_device
from pdrt.engine.config import DEFAULT_KV_CACHE_BYTES, DEFAULT_PREFILL_CHUNK, EngineConfig
from pdrt.errors import ConfigError
from pdrt.worker_profile import prompt_batch_tokens

MODES = ("disaggregated", "colocated")
TRANSFERS = ("shm", "tcp", "auto", "cuda_ipc")
WORKER_ROLES = ("prefill", "decode", "colocated")
_NODE_NAME = re.compile(r"[A-Za-z0-9_]{1,32}")

Port = Annotated[int, Meta(ge=1, le=65535)]
OptionalPort = Annotated[int, Meta(ge=0, le=65535)]  # 0: off
Positive = Annotated[int, Meta(ge=1)]
NonNegative = Annotated[int, Meta(ge=0)]
Seconds = Annotated[float, Meta(gt=0)]
Niceness = Annotated[int, Meta(ge=-20, le=19)]
TenantName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class _Table(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class GatewayConfig(_Table):
    port: Port = 7100
    http_port: OptionalPort = 7180  # the OpenAI-compatible HTTP front and the demo page; 0 turns it off
    api_key: str = ""  # when set, HTTP /v1/ routes need `Authorization: Bearer <key>` (or PDRT_API_KEY)
    # Tenants: name -> key. A tenant holds at most half of the gateway's limits, and shares cached prompt KV
    # with its own requests only (pdrt/roles/tenants.py). Any key opens /v1/ once one is set.
    api_keys: dict[TenantName, Annotated[str, Meta(min_length=1)]] = {}
    enabled: bool = True
    max_open_requests: Positive = 1024
    max_request_failures: Positive = 2  # a request whose workers died or failed it this many times ends with the error
    ttft_slo_s: Seconds = 1.0  # a request meets its SLOs with its first token within this many seconds
    tpot_slo_s: Seconds = 0.1  # and this many seconds per later token (pdrt.metrics.gateway_metrics)

    def __post_init__(self) -> None:
        keys = [*self.api_keys.values(), *([self.api_key] if self.api_key else [])]
        if len(set(keys)) < len(keys):
            raise ConfigError("[gateway] api_key and api_keys must all differ: a key names one tenant")

    def tenants(self) -> dict[str, str]:
        """Each API key and its tenant's name ("" for `api_key`); empty when HTTP needs no key."""
        return {**({self.api_key: ""} if self.api_key else {}), **{k: n for n, k in self.api_keys.items()}}


class WarmupConfig(_Table):
    """The UDP warmup channel; it is off while `key` is empty (set it, or PDRT_WARMUP_KEY)."""

    port: Port = 7102
    key: str = ""


class ControllerConfig(_Table):
    port: Port = 7101
    host: str = ""  # where the controller is reached; on the controller's own node it also binds there
    enabled: bool = True
    metrics_port: OptionalPort = 7103  # HTTP: Prometheus text of every process, merged; 0 turns it off
    balance: bool = True  # move workers between prefill and decode as the load changes (pdrt/control_plane/balancer.py)
    balance_interval_s: Seconds = 30.0  # how often the balancer reads the load; it changes a role at most every two


class EngineSettings(_Table):
    kv_cache_bytes: NonNegative = 0  # 0: 1 GiB on the CPU; on a GPU what its memory leaves (pdrt/devices.py)
    max_prefill_chunk_size: Positive = DEFAULT_PREFILL_CHUNK
    max_model_len: NonNegative = 0  # 0: the model's context
    device: Annotated[str, Meta(pattern=r"^(auto|cpu|cuda(:\d+)?)$")] = "auto"  # auto: CUDA where torch sees a GPU
    gpus: Annotated[str, Meta(pattern=r"^[0-9, ]*$")] = ""  # the GPUs the workers take in turn; "": every one
    gpu_memory_utilization: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.9  # of each GPU, for weights, steps and KV
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    speculate: str = "prompt_lookup"  # speculative decoding: "prompt_lookup", "off", or a draft model's checkpoint


class WorkerGroup(_Table):
    count: NonNegative = 1


class Experimental(_Table):
    """Tuning with measured defaults, for benchmarks and tests: not a supported surface, and it may change.

    A None here leaves the choice to the worker profile (pdrt/worker_profile.py).
    """

    # Gateway: the request deadline, the drain on shutdown, and open drafts.
    request_timeout_s: Seconds = 600.0
    unrouted_wait_s: Seconds = 30.0  # how long a request waits for a worker when none can take it (a restart)
    drain_timeout_s: Seconds = 10.0
    max_drafts: Positive = 1024
    # Conditional disaggregation (pdrt/roles/local_prefill.py): a prompt of at most local_prefill_max_tokens
    # (0: none, and no moves either) is prefilled by its decode worker itself while the prefill workers have at
    # least local_prefill_queue_tokens of prompts waiting, and only while that worker's recent steps, its stalls
    # for such prompts included, average under tpot_slo_s and under local_prefill_max_slowdown times its steps
    # that only decode: the stall is paid by the requests decoding there, and disaggregation exists to bound it.
    # Later, a waiting prompt of any length moves to its decode worker when that leaves fewer prompts past
    # ttft_slo_s, if every stream there stays within half the slowdown's slack over its life.
    local_prefill_max_tokens: NonNegative = 512
    local_prefill_queue_tokens: NonNegative = 512
    local_prefill_max_slowdown: Annotated[float, Meta(ge=1.0)] = 1.25
    # Warmups: how long one holds its prefill, how many at once, how old a datagram may be.
    warmup_ttl_s: Seconds = 10.0
    warmup_max_reservations: Positive = 64
    warmup_max_age_s: Seconds = 5.0
    # The controller's heartbeat period and lease (a process that misses it is lost).
    heartbeat_s: Seconds = 0.25
    lease_s: Seconds = 2.0
    # Engines (pdrt/engine/config.py says what each does).
    block_size: Positive = 16
    max_num_seqs: Positive = 128
    max_num_batched_tokens: Positive = 2048
    hash_seed: int = 0  # every process that exchanges KV must use the same
    kv_lease_s: Seconds = 30.0  # how long a prefill worker holds handed-off KV without an acknowledgement
    min_draft_chunk: Positive = 128
    min_draft_step: Positive = 16
    max_draft_tokens: Positive | None = None
    max_draft_pool_fraction: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.5
    draft_ttl_s: Seconds = 60.0
    # How workers share the machine; None: the worker profile's choice.
    prefill_threads: Positive | None = None
    decode_threads: Positive | None = None
    colocated_threads: Positive | None = None
    prefill_nice: Niceness | None = None
    prompt_batch_tokens: NonNegative | None = None
    borrow_threads: bool | None = None
    own_cores: bool = False  # disaggregated on the CPU: each decode worker on cores of its own (cpu_placement.py)


def role_of(process: str) -> str:
    """The role of a process name of `NodeConfig.process_names` ("decode-b-0" -> "decode")."""
    return process.split("-", 1)[0]


class NodeConfig(_Table):
    model: str = ""
    host: str = "127.0.0.1"
    node: str = ""
    mode: Literal["auto", "disaggregated", "colocated"] = "auto"  # auto: chosen where the node starts (node_mode.py)
    mode_reason: str = ""  # set by pdrt: why `auto` chose the mode it did
    transfer: Literal["shm", "tcp", "auto", "cuda_ipc"] = "auto"
    cluster_key: str = ""  # pdrt/actors/cluster_key.py; `pdrt up` makes one per run when empty
    gateway: GatewayConfig = msgspec.field(default_factory=GatewayConfig)
    controller: ControllerConfig = msgspec.field(default_factory=ControllerConfig)
    warmup: WarmupConfig = msgspec.field(default_factory=WarmupConfig)
    engine: EngineSettings = msgspec.field(default_factory=EngineSettings)
    prefill: WorkerGroup = msgspec.field(default_factory=WorkerGroup)
    decode: WorkerGroup = msgspec.field(default_factory=WorkerGroup)
    colocated: WorkerGroup = msgspec.field(default_factory=WorkerGroup)
    experimental: Experimental = msgspec.field(default_factory=Experimental)

    def __post_init__(self) -> None:
        ClusterKey.parse(self.cluster_key)  # raises ConfigError for a malformed key
        if self.experimental.lease_s <= self.experimental.heartbeat_s:
            raise ConfigError("[experimental] lease_s must be longer than heartbeat_s")
        if self.engine.device == "auto":  # made concrete once, where the node starts: its processes get it so
            self.engine.device = resolve_device("auto")
        if self.mode == "auto":
            self.mode, self.mode_reason = self._auto_mode()
        speculate = self.engine.speculate
        if speculate not in ("off", "prompt_lookup") and not Path(speculate).expanduser().exists():
            raise ConfigError(f"[engine] speculate is 'prompt_lookup', 'off' or a draft model's checkpoint; "
                              f"{speculate!r} is none of them")
        if self.node and not _NODE_NAME.fullmatch(self.node):
            raise ConfigError(f"node must be 1-32 letters, digits or '_', got {self.node!r}")
        if not self.process_names():
            raise ConfigError("this node runs no process: enable the controller or the gateway, or give a worker "
                              "count")

    def _auto_mode(self) -> tuple[str, str]:
        if not self.controller.enabled or self.controller.host not in ("", self.host):
            return "disaggregated", "a node of a cluster (its controller is elsewhere): set `mode` to choose"
        if not (self.prefill.count and self.decode.count):
            return "disaggregated", "this node runs prefill or decode workers only"
        from pdrt.node_mode import choose_mode

        return choose_mode(self)

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

    @property
    def prefilling_role(self) -> str:
        """The role that prefills requests: "prefill" (a decode worker then decodes them) or "colocated"."""
        return "colocated" if self.mode == "colocated" else "prefill"

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
        """A worker's torch threads: `[experimental] <role>_threads`, else the cores split evenly."""
        explicit = getattr(self.experimental, f"{role}_threads")
        if explicit is not None:
            return explicit
        num_workers = max(1, sum(self.worker_counts().values()))
        return max(1, (os.cpu_count() or 1) // num_workers)

    @property
    def worker_device(self) -> str:
        """The device a worker process computes on: on CUDA it sees its own GPU alone (CUDA_VISIBLE_DEVICES,
        pdrt/devices.py), device 0 there."""
        return "cuda" if self.engine.device.startswith("cuda") else self.engine.device

    def engine_config(self, role: str) -> EngineConfig:
        e, x = self.engine, self.experimental
        device = self.worker_device
        pool = e.kv_cache_bytes or (DEFAULT_KV_CACHE_BYTES if device == "cpu" else 0)
        return EngineConfig(model=self.model, device=device, dtype=e.dtype, block_size=x.block_size,
                            kv_cache_memory_bytes=pool, max_model_len=e.max_model_len or None,
                            gpu_memory_utilization=e.gpu_memory_utilization,
                            gpu_sharing=int(os.environ.get(GPU_SHARING_ENV, "1")),
                            max_num_seqs=x.max_num_seqs, max_num_batched_tokens=x.max_num_batched_tokens,
                            max_prefill_chunk_size=e.max_prefill_chunk_size, hash_seed=x.hash_seed,
                            prompt_batch_tokens=prompt_batch_tokens(self, role),
                            num_threads=self.threads_for(role), min_draft_chunk=x.min_draft_chunk,
                            min_draft_step=x.min_draft_step, max_draft_tokens=x.max_draft_tokens,
                            max_draft_pool_fraction=x.max_draft_pool_fraction, speculate=self.engine.speculate)

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
    "PDRT_DEVICE": ("engine", "device"),
    "PDRT_PREFILL_CHUNK": ("engine", "max_prefill_chunk_size"),
    "PDRT_WARMUP_KEY": ("warmup", "key"),
    "PDRT_WARMUP_PORT": ("warmup", "port"),
    "PDRT_HTTP_PORT": ("gateway", "http_port"),
    "PDRT_API_KEY": ("gateway", "api_key"),
    "PDRT_API_KEYS": ("gateway", "api_keys"),  # "name=key,name=key"
    "PDRT_CLUSTER_KEY": ("cluster_key",),
}


# Secrets a process also takes from its own environment when it starts (systemd passes them with
# EnvironmentFile=), so that they need not be written into the config JSON it reads.
SECRET_ENVIRONMENT = ("PDRT_WARMUP_KEY", "PDRT_API_KEY", "PDRT_API_KEYS", "PDRT_CLUSTER_KEY")


def with_secrets(config: NodeConfig, environ: dict[str, str] | None = None) -> NodeConfig:
    """`config` with the SECRET_ENVIRONMENT values that `environ` sets (non-empty) in place of its own."""
    environ = os.environ if environ is None else environ
    found = {name: environ[name] for name in SECRET_ENVIRONMENT if name in ENVIRONMENT and environ.get(name)}
    if not found:
        return config
    raw = msgspec.to_builtins(config)
    for name, value in found.items():
        _set(raw, ENVIRONMENT[name], _environment_value(name, value))
    return _convert(raw, "the node config with secrets from the environment")


def _environment_value(name: str, value: str) -> object:
    """The setting an environment variable's text stands for: an integer, a table of API keys, or the text."""
    key = ENVIRONMENT[name][-1]
    if key in ("port", "http_port", "kv_cache_bytes", "max_prefill_chunk_size"):
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{name} must be an integer, got {value!r}") from None
    if key == "api_keys":
        pairs = [item.partition("=") for item in value.split(",") if item.strip()]
        if any(not sep for _, sep, _ in pairs):
            raise ConfigError(f"{name} is a list of name=key, separated by commas")
        return {tenant.strip(): api_key.strip() for tenant, _, api_key in pairs}
    return value


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
            _set(raw, key, _environment_value(name, environ[name]))
    for key, value in (overrides or {}).items():
        if value is not None:
            _set(raw, key, value)
    if not raw.get("model"):  # before the config is made: `mode = "auto"` looks for the model's profile
        from pdrt.models.fetch import default_model_dir, is_fetched

        if not is_fetched():
            raise ConfigError("no model given and the default model is not fetched; run `pdrt model fetch`")
        raw["model"] = str(default_model_dir())
    return _convert(raw, path or "the node config")
