"""What `pdrt up` checks before it starts a process: the causes a restart cannot mend that it can see from outside.

A port of the node's that another process holds, shared memory too small
for the workers' KV pools, a pool too small for one block of the model's
KV, or a draft model of another vocabulary than the model's would each make
a process exit as soon as it tried, seconds into its start (after loading
its model). Checked here
first, the run fails at once with the cause (the port, the path, the size).
The processes check again themselves, since what is free now may be taken
a moment later; a process that cannot start exits with status 2 either way.
"""

import json
import os
import socket
from pathlib import Path

from pdrt.engine.config import DEFAULT_KV_CACHE_BYTES
from pdrt.errors import ConfigError
from pdrt.node_config import NodeConfig

SHM_DIR = Path("/dev/shm")


def listening_ports(config: NodeConfig) -> list[tuple[str, int, socket.SocketKind]]:
    """Every fixed port this node's processes bind: what it is for, its number, TCP or UDP."""
    ports = []
    if config.gateway.enabled:
        ports.append(("[gateway] port", config.gateway.port, socket.SOCK_STREAM))
        if config.gateway.http_port:
            ports.append(("[gateway] http_port", config.gateway.http_port, socket.SOCK_STREAM))
        if config.warmup.key:
            ports.append(("[warmup] port", config.warmup.port, socket.SOCK_DGRAM))
    if config.controller.enabled and config.controller.host in ("", config.host):
        ports.append(("[controller] port", config.controller.port, socket.SOCK_STREAM))
    return ports


def check_ports(config: NodeConfig) -> None:
    for what, port, kind in listening_ports(config):
        with socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, kind) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ and aiohttp bind
            try:
                probe.bind((config.host, port))
            except OSError as exc:
                raise ConfigError(f"cannot listen on {config.host}:{port} ({what}): {exc.strerror or exc}") from exc


def check_shared_memory(config: NodeConfig) -> None:
    """The KV pools of a disaggregated CPU node live in /dev/shm: all of them must fit there."""
    if config.mode != "disaggregated" or config.worker_device != "cpu" or config.transfer not in ("shm", "auto"):
        return
    num_workers = config.prefill.count + config.decode.count
    pool = config.engine.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES
    try:
        stats = os.statvfs(SHM_DIR)
    except OSError:
        return  # no /dev/shm: the workers say what they make of that
    free = stats.f_bavail * stats.f_frsize
    if num_workers * pool > free:
        raise ConfigError(f"{num_workers} KV pools of {pool} bytes need {num_workers * pool} bytes in {SHM_DIR}, "
                          f"which has {free} bytes free: lower [engine] kv_cache_bytes or enlarge {SHM_DIR}")


MIN_KV_ELEMENT_BYTES = 2  # the narrowest KV dtype a worker may choose (16 bits)


def _model_config(model: str) -> dict:
    """A checkpoint directory's config.json (a multimodal one's text part); OSError or ValueError if unreadable."""
    c = json.loads((Path(model).expanduser() / "config.json").read_text())
    return c.get("text_config", c)


def smallest_block_bytes(model: str, block_size: int) -> int | None:
    """The bytes of one KV block of `model` in its narrowest dtype, from its config.json; None if unreadable."""
    try:
        c = _model_config(model)
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        return 2 * c["num_hidden_layers"] * block_size * c.get("num_key_value_heads", heads) * head_dim \
            * MIN_KV_ELEMENT_BYTES
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError, AttributeError):
        return None  # the worker loads the model and says what is wrong with it


def check_kv_pool(config: NodeConfig) -> None:
    """A KV pool set smaller than one block holds nothing, whatever dtype the workers choose."""
    pool = config.engine.kv_cache_bytes
    block = smallest_block_bytes(config.model, config.experimental.block_size) if pool else None
    if block is not None and pool < block:
        raise ConfigError(f"a KV pool of {pool} bytes holds no block of {block} bytes or more: "
                          "raise [engine] kv_cache_bytes")


def check_draft_model(config: NodeConfig) -> None:
    """A draft model proposes token ids of the model's vocabulary, or none it can use."""
    speculate = config.engine.speculate
    if speculate in ("off", "prompt_lookup"):
        return
    try:
        draft, target = _model_config(speculate)["vocab_size"], _model_config(config.model)["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return  # the workers load both and say what is wrong
    if draft != target:
        raise ConfigError(f"the draft model's vocabulary ({draft} tokens) is not the target's ({target}): "
                          "[engine] speculate needs a draft model of the same vocabulary")


def check(config: NodeConfig) -> None:
    """Raise ConfigError with the first cause found that would stop the node from starting."""
    check_ports(config)
    check_kv_pool(config)
    check_draft_model(config)
    check_shared_memory(config)
