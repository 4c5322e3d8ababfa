"""`pdrt systemd`: units for a default node and for both nodes of a two-node cluster, checked line by line
and by `systemd-analyze verify` where it is installed; their ExecStopPost run for real."""

import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pdrt.cli import main
from pdrt.deploy import UnitOptions, render_units, resolved_config
from pdrt.errors import ConfigError
from pdrt.node_config import Experimental, NodeConfig, WorkerGroup, load_node_config

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
NODE_A = """
model = "/srv/models/SmolLM2"
host = "10.0.0.1"
transfer = "auto"
[warmup]
key = "do not write me down"
[prefill]
count = 2
[decode]
count = 0
[experimental]
drain_timeout_s = 25
"""
NODE_B = """
model = "/srv/models/SmolLM2"
host = "10.0.0.2"
node = "b"
transfer = "auto"
[controller]
host = "10.0.0.1"
enabled = false
[gateway]
enabled = false
[prefill]
count = 0
[decode]
count = 2
[experimental]
decode_threads = 4
"""


def split(**settings) -> NodeConfig:
    """A node of prefill and decode workers, whatever this host's cores would choose."""
    return NodeConfig(model="/m", mode="disaggregated", **settings)


def config_from(tmp_path: Path, toml: str) -> NodeConfig:
    path = tmp_path / f"node-{uuid.uuid4().hex[:6]}.toml"
    path.write_text(toml)
    return load_node_config(str(path), environ={})


def options(tmp_path: Path, **kwargs) -> UnitOptions:
    kwargs.setdefault("run_id", "abc123")
    return UnitOptions(config_json=str(tmp_path / "node.json"), **kwargs)


def directives(text: str) -> list[tuple[str, str]]:
    """(key, value) of every directive line, in order."""
    return [tuple(line.split("=", 1)) for line in text.splitlines() if "=" in line and not line.startswith("#")]


def values(text: str, key: str) -> list[str]:
    return [value for k, value in directives(text) if k == key]


def value(text: str, key: str) -> str:
    (found,) = values(text, key)
    return found


def write(units: dict[str, str], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    for name, text in units.items():
        (out / name).write_text(text)
    return [out / name for name in units]


def verify(paths: list[Path]) -> None:
    """`systemd-analyze verify` accepts the units without a warning (skipped where it is not installed)."""
    if SYSTEMD_ANALYZE is None:
        return
    result = subprocess.run([SYSTEMD_ANALYZE, "verify", *map(str, paths)], capture_output=True, text=True,
                            timeout=60)
    # Each unit wants network-online.target, which a container without systemd may lack; nothing else may warn.
    problems = [line for line in result.stderr.splitlines() if line.strip() and "network-online" not in line]
    assert result.returncode == 0 and not problems, result.stderr


# -- one node, default config ------------------------------------------------------------------


def test_default_node_gets_a_service_per_process_and_a_target_that_wants_them_all(tmp_path: Path):
    units = render_units(split(), options(tmp_path))

    services = ["pdrt-controller.service", "pdrt-prefill-0.service", "pdrt-decode-0.service", "pdrt-gateway.service"]
    assert list(units) == [*services, "pdrt.target"]
    assert value(units["pdrt.target"], "Wants").split() == services
    assert value(units["pdrt.target"], "WantedBy") == "multi-user.target"
    for name in ("controller", "prefill-0", "decode-0", "gateway"):
        text = units[f"pdrt-{name}.service"]
        assert value(text, "ExecStart") == f"{sys.executable} -m pdrt.process {name}"
        assert value(text, "ExecStopPost") == f"{sys.executable} -m pdrt.deploy.cleanup abc123 {name}"
        env = values(text, "Environment")
        assert f"PDRT_NODE_CONFIG={tmp_path / 'node.json'}" in env and "PDRT_RUN_ID=abc123" in env
        assert value(text, "PartOf") == "pdrt.target"
        assert (value(text, "Restart"), value(text, "KillSignal"), value(text, "KillMode")) == (
            "on-failure", "SIGTERM", "mixed")
        assert value(text, "EnvironmentFile") == "-/etc/pdrt/pdrt.env"


def test_default_units_pass_systemd_analyze_verify(tmp_path: Path):
    if SYSTEMD_ANALYZE is None:
        pytest.skip("systemd-analyze is not installed")
    verify(write(render_units(split(), options(tmp_path)), tmp_path / "units"))


def test_workers_and_gateway_start_after_the_controller_and_the_gateway_after_the_workers(tmp_path: Path):
    units = render_units(split(), options(tmp_path))

    assert value(units["pdrt-controller.service"], "After") == "network-online.target"
    for worker in ("prefill-0", "decode-0"):
        text = units[f"pdrt-{worker}.service"]
        assert "pdrt-controller.service" in value(text, "After").split()
        assert "pdrt-controller.service" in value(text, "Wants").split()
    gateway_after = value(units["pdrt-gateway.service"], "After").split()
    # systemd stops in the reverse order: the gateway drains while the workers still run.
    assert {"pdrt-controller.service", "pdrt-prefill-0.service", "pdrt-decode-0.service"} <= set(gateway_after)
    assert "pdrt-prefill-0.service" not in value(units["pdrt-gateway.service"], "Wants")


def test_the_gateways_stop_timeout_covers_its_drain(tmp_path: Path):
    config = config_from(tmp_path, NODE_A)
    units = render_units(config, options(tmp_path, stop_timeout_s=10.0))
    assert value(units["pdrt-gateway.service"], "TimeoutStopSec") == "35s"
    assert value(units["pdrt-prefill-0.service"], "TimeoutStopSec") == "10s"


def test_restart_backoff_steps_only_for_systemd_254_and_later(tmp_path: Path):
    old = render_units(split(), options(tmp_path, systemd_version=252))["pdrt-gateway.service"]
    new = render_units(split(), options(tmp_path, systemd_version=254))["pdrt-gateway.service"]
    assert not values(old, "RestartSteps") and not values(old, "RestartMaxDelaySec")
    assert value(new, "RestartSteps") == "5" and value(new, "RestartMaxDelaySec") == "30s"
    assert value(old, "RestartSec") == value(new, "RestartSec") == "1s"


def test_hardening_leaves_dev_shm_and_gpus_reachable(tmp_path: Path):
    text = render_units(split(), options(tmp_path))["pdrt-prefill-0.service"]
    assert value(text, "ProtectSystem") == "strict" and value(text, "PrivateTmp") == "yes"
    assert not values(text, "PrivateDevices") and not values(text, "DevicePolicy")
    assert not any("/dev/shm" in v for v in values(text, "InaccessiblePaths") + values(text, "ReadOnlyPaths"))
    assert value(text, "CacheDirectory") == "pdrt"
    elsewhere = render_units(split(), options(tmp_path, cache_dir="/srv/pdrt cache"))
    assert value(elsewhere["pdrt-prefill-0.service"], "ReadWritePaths") == '-"/srv/pdrt cache"'


def test_gpus_threads_pinning_and_memory_limits_go_to_workers_alone(tmp_path: Path):
    config = config_from(tmp_path, NODE_B.replace("[experimental]", "[engine]\ndevice = \"cuda\"\n[experimental]"))
    units = render_units(config, options(tmp_path, gpus=["2", "3"], pin_cpus=True, num_cpus=8, memory_max="48G"))

    assert list(units) == ["pdrt-decode-b-0.service", "pdrt-decode-b-1.service", "pdrt.target"]
    for i, (gpu, cpus) in enumerate((("2", "0-3"), ("3", "4-7"))):
        text = units[f"pdrt-decode-b-{i}.service"]
        env = values(text, "Environment")
        assert f"CUDA_VISIBLE_DEVICES={gpu}" in env and "OMP_NUM_THREADS=4" in env
        assert value(text, "CPUAffinity") == cpus and value(text, "MemoryMax") == "48G"
    verify(write(units, tmp_path / "units"))


def test_a_decode_worker_that_borrows_threads_is_pinned_to_the_prefill_workers_cpus_too(tmp_path: Path):
    config = split(prefill=WorkerGroup(count=2), decode=WorkerGroup(count=1),
                        experimental=Experimental(prefill_threads=2, decode_threads=3))
    units = render_units(config, options(tmp_path, pin_cpus=True, num_cpus=8))
    assert [value(units[f"pdrt-{name}.service"], "CPUAffinity") for name in ("prefill-0", "prefill-1", "decode-0")] \
        == ["0-1", "2-3", "4-6 0-1 2-3"]
    config.experimental.borrow_threads = False
    units = render_units(config, options(tmp_path, pin_cpus=True, num_cpus=8))
    assert value(units["pdrt-decode-0.service"], "CPUAffinity") == "4-6"
    # A prefill worker may take back the niceness it yields (pdrt/priority.py, CatchUp); no other needs to.
    assert [values(units[f"pdrt-{name}.service"], "LimitNICE") for name in ("prefill-0", "prefill-1", "decode-0")] \
        == [["+0"], ["+0"], []]
    verify(write(units, tmp_path / "units"))


def test_gpus_for_a_cpu_engine_and_pinning_beyond_the_hosts_cpus_are_refused(tmp_path: Path):
    with pytest.raises(ConfigError, match="device"):
        render_units(split(), options(tmp_path, gpus=["0"]))
    with pytest.raises(ConfigError, match="CPUs"):
        render_units(config_from(tmp_path, NODE_B), options(tmp_path, pin_cpus=True, num_cpus=6))


@pytest.mark.parametrize("kwargs", [{"prefix": "pdrt prod"}, {"run_id": "a-b"}, {"config_json": "node.json"},
                                    {"memory_max": "lots"}])
def test_bad_unit_options_are_refused(tmp_path: Path, kwargs: dict):
    with pytest.raises(ConfigError):
        UnitOptions(**{"config_json": "/etc/pdrt/node.json", "run_id": "abc", **kwargs})


def test_paths_with_blanks_and_percent_signs_are_quoted_and_escaped(tmp_path: Path):
    odd = tmp_path / "venv 1%" / "python"
    odd.parent.mkdir()
    odd.symlink_to(sys.executable)
    units = render_units(split(), options(tmp_path, python=str(odd)))
    text = units["pdrt-gateway.service"]
    assert value(text, "ExecStart") == f'"{str(odd).replace("%", "%%")}" -m pdrt.process gateway'
    verify(write(units, tmp_path / "units"))


# -- two nodes -----------------------------------------------------------------------------------


def test_node_a_runs_controller_prefill_and_gateway(tmp_path: Path):
    units = render_units(config_from(tmp_path, NODE_A), options(tmp_path))
    assert list(units) == ["pdrt-controller.service", "pdrt-prefill-0.service", "pdrt-prefill-1.service",
                           "pdrt-gateway.service", "pdrt.target"]
    verify(write(units, tmp_path / "a"))


def test_node_b_runs_decode_workers_alone_for_the_controller_of_node_a(tmp_path: Path):
    config = config_from(tmp_path, NODE_B)
    units = render_units(config, options(tmp_path))

    assert list(units) == ["pdrt-decode-b-0.service", "pdrt-decode-b-1.service", "pdrt.target"]
    for name in ("decode-b-0", "decode-b-1"):
        text = units[f"pdrt-{name}.service"]
        assert value(text, "After") == value(text, "Wants") == "network-online.target"  # no controller here
    assert config.controller_address == "tcp://10.0.0.1:7101"
    assert config.ephemeral_address() == "tcp://10.0.0.2:*"
    verify(write(units, tmp_path / "b"))


def test_the_config_json_holds_no_secret_and_the_thread_counts_the_units_use(tmp_path: Path):
    config = config_from(tmp_path, NODE_A)
    assert config.warmup.key
    resolved = NodeConfig.from_json(resolved_config(config).to_json())
    assert resolved.warmup.key == "" and b"do not write me down" not in resolved_config(config).to_json()
    assert resolved.experimental.prefill_threads == config.threads_for("prefill")
    assert (resolved.host, resolved.transfer, resolved.experimental.drain_timeout_s) == ("10.0.0.1", "auto", 25)


# -- the command and the cleanup it installs ------------------------------------------------------------


def test_pdrt_systemd_writes_the_units_and_the_config_json_and_rewrites_them_identically(tmp_path: Path, capsys):
    toml = tmp_path / "node.toml"
    toml.write_text(NODE_B)
    out = tmp_path / "units"
    argv = ["systemd", "--config", str(toml), "--out", str(out), "--user", "pdrt", "--config-json",
            str(tmp_path / "etc" / "node.json"), "--env-file", "/etc/pdrt/secrets.env"]

    assert main(argv) == 0
    first = {p.name: p.read_text() for p in out.iterdir()}
    assert main(argv) == 0

    assert {p.name: p.read_text() for p in out.iterdir()} == first
    assert sorted(first) == ["pdrt-decode-b-0.service", "pdrt-decode-b-1.service", "pdrt.target"]
    text = first["pdrt-decode-b-0.service"]
    assert value(text, "User") == "pdrt" and value(text, "EnvironmentFile") == "-/etc/pdrt/secrets.env"
    written = NodeConfig.from_json((tmp_path / "etc" / "node.json").read_bytes())
    assert written.process_names() == ["decode-b-0", "decode-b-1"]
    assert str(out / "pdrt.target") in capsys.readouterr().out.splitlines()


def test_pdrt_systemd_with_a_bad_config_writes_nothing(tmp_path: Path):
    toml = tmp_path / "node.toml"
    toml.write_text(NODE_B + '[engine]\ndevice = "cpu"\n')
    assert main(["systemd", "--config", str(toml), "--out", str(tmp_path / "units"), "--gpus", "0"]) == 2
    assert not (tmp_path / "units").exists()


def test_exec_stop_post_removes_its_own_processes_segments_and_no_other(tmp_path: Path):
    run_id = uuid.uuid4().hex[:10]
    units = render_units(split(decode=WorkerGroup(count=11)), options(tmp_path, run_id=run_id))
    names = ["decode-1-x", "decode-1-y", "decode-10-x", "prefill-1-x"]
    for name in names:
        Path(f"/dev/shm/pdrt-{run_id}-{name}").write_bytes(b"kv")
    try:
        command = shlex.split(value(units["pdrt-decode-1.service"], "ExecStopPost"))
        assert subprocess.run(command, timeout=30).returncode == 0
        left = sorted(f.removeprefix(f"pdrt-{run_id}-") for f in os.listdir("/dev/shm") if run_id in f)
        assert left == ["decode-10-x", "prefill-1-x"]
    finally:
        for name in names:
            Path(f"/dev/shm/pdrt-{run_id}-{name}").unlink(missing_ok=True)


def test_every_directive_is_a_key_value_line_under_a_section(tmp_path: Path):
    for text in render_units(config_from(tmp_path, NODE_A), options(tmp_path)).values():
        for line in text.splitlines():
            assert not line or line.startswith("#") or re.fullmatch(r"\[(Unit|Service|Install)\]", line) \
                or re.fullmatch(r"[A-Za-z]+=\S.*", line), line
