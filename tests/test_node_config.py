"""The node config's multi-node settings: which processes run here, what they are named, where they connect."""

from pathlib import Path

import pytest

from pdrt.errors import ConfigError
from pdrt.node_config import NodeConfig, load_node_config, with_secrets

DECODE_ONLY = """
model = "/m"
host = "10.0.0.2"
node = "b"
[controller]
host = "10.0.0.1"
port = 7201
enabled = false
[gateway]
enabled = false
[prefill]
count = 0
[decode]
count = 3
"""


def load(tmp_path: Path, toml: str, environ: dict[str, str] | None = None) -> NodeConfig:
    path = tmp_path / "node.toml"
    path.write_text(toml)
    return load_node_config(str(path), environ=environ or {})


def test_a_node_of_decode_workers_runs_them_alone_named_after_it_and_reaches_the_remote_controller(tmp_path: Path):
    config = load(tmp_path, DECODE_ONLY)
    assert config.process_names() == ["decode-b-0", "decode-b-1", "decode-b-2"]
    assert config.controller_address == "tcp://10.0.0.1:7201"
    assert config.ephemeral_address() == "tcp://10.0.0.2:*"  # its inboxes: on its own address
    assert config.threads_for("decode") >= 1


def test_a_single_node_keeps_its_names_and_reaches_the_controller_on_its_own_host():
    config = NodeConfig(model="/m", mode="disaggregated", host="10.0.0.1")
    assert config.process_names() == ["controller", "prefill-0", "decode-0", "gateway"]
    assert config.controller_address == "tcp://10.0.0.1:7101"
    assert config.gateway_address == "tcp://10.0.0.1:7100"


def test_the_controller_node_may_run_without_a_gateway_and_without_workers(tmp_path: Path):
    config = load(tmp_path, 'model = "/m"\n[gateway]\nenabled = false\n[prefill]\ncount = 0\n[decode]\ncount = 0\n')
    assert config.process_names() == ["controller"]


def test_a_node_that_runs_nothing_is_refused(tmp_path: Path):
    with pytest.raises(ConfigError, match="no process"):
        load(tmp_path, DECODE_ONLY.replace("count = 3", "count = 0"))


@pytest.mark.parametrize("node", ["b-1", "b/1", "x" * 33])
def test_node_names_that_would_blur_process_names_are_refused(tmp_path: Path, node: str):
    with pytest.raises(ConfigError, match="node"):
        load(tmp_path, f'model = "/m"\nnode = "{node}"\n')


def test_environment_names_the_node_and_the_controller_host(tmp_path: Path):
    config = load(tmp_path, 'model = "/m"\n', {"PDRT_NODE": "c", "PDRT_CONTROLLER_HOST": "10.0.0.9"})
    assert config.process_names()[1] == "prefill-c-0"
    assert config.controller_address == "tcp://10.0.0.9:7101"


def test_transfer_auto_is_accepted_and_an_unknown_one_is_not(tmp_path: Path):
    assert load(tmp_path, 'model = "/m"\ntransfer = "auto"\n').transfer == "auto"
    with pytest.raises(ConfigError, match="transfer"):
        load(tmp_path, 'model = "/m"\ntransfer = "rdma"\n')


def test_secrets_from_the_environment_take_the_place_of_the_configs_and_nothing_else_does():
    config = NodeConfig(model="/m", mode="disaggregated")
    updated = with_secrets(config, {"PDRT_WARMUP_KEY": "k", "PDRT_PORT": "9999"})
    assert updated.warmup.key == "k" and updated.gateway.port == 7100
    assert with_secrets(config, {"PDRT_WARMUP_KEY": ""}) is config
    tenants = with_secrets(config, {"PDRT_API_KEYS": "alpha=ka, beta.2=kb"}).gateway
    assert tenants.api_keys == {"alpha": "ka", "beta.2": "kb"} and tenants.tenants() == {"ka": "alpha", "kb": "beta.2"}


@pytest.mark.parametrize("keys", ["alpha", "alpha=k,beta=k", "has space=k", "alpha="])
def test_api_keys_are_named_distinct_and_not_empty(tmp_path: Path, keys: str):
    with pytest.raises(ConfigError, match="API_KEYS|api_keys|differ"):
        load(tmp_path, 'model = "/m"\n', {"PDRT_API_KEYS": keys})


@pytest.mark.parametrize(("toml", "where"), [
    ("[gateway]\nport = 0", "gateway.port"), ("[gateway]\nttft_slo_s = 0", "gateway.ttft_slo_s"),
    ("[engine]\nkv_cache_bytes = -1", "engine.kv_cache_bytes"), ('[engine]\ndevice = "gpu"', "engine.device"),
    ("[engine]\ngpu_memory_utilization = 1.5", "engine.gpu_memory_utilization"),
    ('[engine]\ndtype = "int4"', "engine.dtype"), ("[decode]\ncount = -1", "decode.count"),
    ("[experimental]\nprefill_nice = 20", "experimental.prefill_nice"),
    ("[experimental]\nlocal_prefill_max_slowdown = 0.9", "experimental.local_prefill_max_slowdown"),
    ("[experimental]\nprompt_batch_tokens = -1", "experimental.prompt_batch_tokens"),
    ("[prefill]\nnice = 10", "nice"),  # the old per-role settings are gone, not ignored
    ('[gateway]\napi_key = "k"\napi_keys = {a = "k"}', "differ"),
])
def test_out_of_range_or_unknown_settings_are_refused_naming_where(tmp_path: Path, toml: str, where: str):
    with pytest.raises(ConfigError, match=where.replace(".", r"\.")):
        load(tmp_path, 'model = "/m"\n' + toml)


def test_the_experimental_table_holds_tuning_and_the_public_tables_do_not(tmp_path: Path):
    config = load(tmp_path, 'model = "/m"\n[experimental]\nheartbeat_s = 0.5\nlease_s = 4.0\ndecode_threads = 3')
    assert (config.experimental.heartbeat_s, config.experimental.lease_s, config.threads_for("decode")) == (0.5, 4.0, 3)
    with pytest.raises(ConfigError, match="lease_s"):
        load(tmp_path, 'model = "/m"\n[experimental]\nheartbeat_s = 2.0')
    with pytest.raises(ConfigError, match="heartbeat_s"):
        load(tmp_path, 'model = "/m"\n[controller]\nheartbeat_s = 0.5')
