"""Devices without a GPU: `auto` resolution, the GPUs each worker gets, a GPU pool's arithmetic, and the
combinations refused before any process starts (here, where torch sees no GPU, for real)."""

import subprocess
import sys

import pytest

from pdrt.devices import (
    GPU_SHARING_ENV,
    activation_reserve_bytes,
    check_device_support,
    gpu_assignment,
    gpu_pool_bytes,
    gpu_sharing,
    node_gpus,
    process_environments,
    resolve_device,
)
from pdrt.errors import ConfigError
from pdrt.node_config import NodeConfig, load_node_config
from pdrt.supervisor.supervisor import Supervisor

GIB = 1 << 30


def config(**settings) -> NodeConfig:
    import msgspec

    return NodeConfig.from_json(msgspec.json.encode({"model": "/m", **settings}))


def test_auto_is_cuda_where_torch_sees_a_gpu_and_the_cpu_here():
    assert resolve_device("auto", num_gpus=0) == "cpu"
    assert resolve_device("auto", num_gpus=2) == "cuda"
    assert resolve_device("cuda:1", num_gpus=0) == "cuda:1"  # as given: checked where the node starts
    assert config().engine.device == "cpu"  # this machine: no GPU
    assert config(engine={"device": "cpu"}).engine_config("decode").kv_cache_memory_bytes == GIB
    assert load_node_config(environ={"PDRT_DEVICE": "cpu", "PDRT_MODEL": "/m"}).engine.device == "cpu"
    # A worker sees its own GPU alone: its engine and its KV source both use device 0 there.
    gpu = config(engine={"device": "cuda:1"})
    assert gpu.worker_device == gpu.engine_config("prefill").device == "cuda"


def test_a_node_takes_the_gpus_it_is_given_or_all_and_refuses_those_that_do_not_exist():
    assert node_gpus("cpu", "", 0) == []
    assert node_gpus("cuda", "", 4) == ["0", "1", "2", "3"]
    assert node_gpus("cuda", "3, 1", 4) == ["3", "1"]
    assert node_gpus("cuda:2", "", 4) == ["2"]
    with pytest.raises(ConfigError, match="sees no CUDA device"):
        node_gpus("cuda", "", 0)
    with pytest.raises(ConfigError, match="GPU '5' does not exist"):
        node_gpus("cuda", "0,5", 4)


def test_workers_take_the_gpus_in_turn_and_share_one_when_there_are_more_workers():
    names = config(mode="colocated", colocated={"count": 3}, engine={"device": "cpu"}).process_names()
    assignment = gpu_assignment(names, ["0", "1"])
    assert assignment == {"controller": "", "gateway": "", "colocated-0": "0", "colocated-1": "1",
                          "colocated-2": "0"}
    assert [gpu_sharing(assignment, n) for n in ("colocated-0", "colocated-1", "colocated-2")] == [2, 1, 2]
    envs = process_environments("cuda", "", "colocated", {"colocated": 3}, "cuda_ipc", names, num_gpus=2)
    assert envs["colocated-2"] == {"CUDA_VISIBLE_DEVICES": "0", GPU_SHARING_ENV: "2"}
    assert envs["gateway"]["CUDA_VISIBLE_DEVICES"] == ""  # the gateway and the controller see no GPU
    assert process_environments("cpu", "", "disaggregated", {"prefill": 1, "decode": 1}, "auto", names) == \
        {name: {} for name in names}


def test_a_gpu_pool_is_the_workers_share_less_weights_and_a_steps_activations():
    assert gpu_pool_bytes(80 * GIB, 0.9, 2, 2 * GIB, 1 * GIB) == int(80 * GIB * 0.9 / 2) - 3 * GIB
    with pytest.raises(ConfigError, match="no GPU memory left"):
        gpu_pool_bytes(16 * GIB, 0.5, 4, 2 * GIB, GIB)
    # Llama-3.1-8B's shape in bf16, a 2048-token step: MLP intermediates and logits dominate
    assert activation_reserve_bytes(2048, 4096, 14336, 128256, 2) == 2 * 2048 * (3 * 14336 + 4 * 4096 + 128256) * 2


def test_what_cannot_run_is_refused_before_anything_starts():
    split = {"prefill": 1, "decode": 1}
    with pytest.raises(ConfigError, match="keeps the pool in host memory"):
        check_device_support("cuda", "disaggregated", split, "shm")
    for transfer in ("cuda_ipc", "tcp", "auto"):  # device pools: shared by IPC, served through pinned memory
        check_device_support("cuda", "disaggregated", split, transfer)
    check_device_support("cuda", "colocated", {"colocated": 2}, "tcp")
    check_device_support("cuda", "disaggregated", {"prefill": 0, "decode": 2}, "tcp")  # pulls into the GPU
    with pytest.raises(ConfigError, match="between GPUs"):
        check_device_support("cpu", "disaggregated", split, "cuda_ipc")
    assert config(engine={"device": "cuda"}).transfer == "auto"
    with pytest.raises(ConfigError, match="sees no CUDA device"):  # this machine, for real
        Supervisor(config(engine={"device": "cuda"}), "r")


def test_pdrt_up_device_cuda_on_a_machine_without_a_gpu_says_so_and_starts_nothing(model_dirs):
    done = subprocess.run([sys.executable, "-m", "pdrt.cli", "up", "--device", "cuda", "--colocated",
                           "--model", str(model_dirs["llama"])], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "torch sees no CUDA device" in done.stderr
