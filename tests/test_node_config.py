"""The node config's multi-node settings: which processes run here, what they are named, where they connect."""

from pathlib import Path

import pytest

from pdrt.errors import ConfigError
from pdrt.node_config import NodeConfig, load_node_config, with_secrets
from pdrt.process import catches_up

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
    config = NodeConfig(model="/m", host="10.0.0.1")
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
    config = NodeConfig(model="/m")
    updated = with_secrets(config, {"PDRT_WARMUP_KEY": "k", "PDRT_PORT": "9999"})
    assert updated.warmup.key == "k" and updated.gateway.port == 7100
    assert with_secrets(config, {"PDRT_WARMUP_KEY": ""}) is config


@pytest.mark.parametrize("toml", ["[prefill]\nnice = 20", "[decode]\nnice = -21",
                                  "[gateway]\nlocal_prefill_max_slowdown = 0.9", "[prefill]\ncatch_up_wait = 0",
                                  "[prefill]\ncatch_up_wait = 1.5", "[prefill]\nprompt_batch_tokens = -1",
                                  '[prefill]\nprompt_order = "fifo"'])
def test_out_of_range_priorities_slowdowns_and_orders_are_refused(tmp_path: Path, toml: str):
    with pytest.raises(ConfigError):
        load(tmp_path, 'model = "/m"\n' + toml)


def test_the_prefill_workers_yield_the_cpu_by_default_and_the_others_do_not(tmp_path: Path):
    config = load(tmp_path, 'model = "/m"\n[prefill]\ncount = 2')
    assert (config.prefill.nice, config.decode.nice, config.colocated.nice) == (10, 0, 0)


def test_the_prefill_worker_of_a_model_below_catch_up_below_params_alone_catches_up():
    config = NodeConfig(model="/m")
    threshold = config.prefill.catch_up_below_params
    assert catches_up(config, "prefill", threshold - 1) and not catches_up(config, "prefill", threshold)
    assert not catches_up(config, "decode", 1) and not catches_up(config, "colocated", 1)


def test_prefill_workers_on_the_cpu_alone_take_prompts_one_by_one_unless_told_otherwise(tmp_path: Path):
    config = NodeConfig(model="/m")
    assert config.engine_config("prefill").prompt_batch_tokens == 64
    assert config.engine_config("decode").prompt_batch_tokens is None
    assert config.engine_config("colocated").prompt_batch_tokens is None
    on_gpu = load(tmp_path, 'model = "/m"\n[engine]\ndevice = "cuda"')
    assert on_gpu.engine_config("prefill").prompt_batch_tokens is None
    told = load(tmp_path, 'model = "/m"\n[engine]\ndevice = "cuda"\n[prefill]\nprompt_batch_tokens = 256')
    assert told.engine_config("prefill").prompt_batch_tokens == 256


def test_the_deadline_order_is_refused_where_prompts_batch_side_by_side(tmp_path: Path):
    deadline = '\n[prefill]\nprompt_order = "deadline"'
    assert load(tmp_path, 'model = "/m"' + deadline).prefill.prompt_order == "deadline"
    with pytest.raises(ConfigError, match="prompt_batch_tokens"):
        load(tmp_path, 'model = "/m"\n[engine]\ndevice = "cuda"' + deadline)
    told = load(tmp_path, 'model = "/m"\n[engine]\ndevice = "cuda"' + deadline + "\nprompt_batch_tokens = 256")
    assert told.engine_config("prefill").prompt_batch_tokens == 256
