"""`mode = "auto"`: a node's mode chosen from the model's profile on this host, else from the hardware."""

import json
import re
import shutil

import pytest

from pdrt.node_config import ControllerConfig, EngineSettings, NodeConfig, WorkerGroup
from pdrt.node_mode import MIN_SPLIT_CORES, choose_mode
from pdrt.planner.profile import measure_profile


def test_without_a_profile_a_cpu_node_splits_only_where_its_workers_get_cores_of_their_own(tmp_path):
    config = NodeConfig(model=str(tmp_path / "no-such-model"), mode="colocated")
    assert choose_mode(config, cores=2)[0] == "colocated"
    assert "2 cores" in choose_mode(config, cores=2)[1]
    assert choose_mode(config, cores=MIN_SPLIT_CORES)[0] == "disaggregated"


@pytest.mark.parametrize(("device", "gpus", "mode"), [
    ("cuda", "0,1", "disaggregated"), ("cuda", "3", "colocated"), ("cuda:1", "", "colocated"),
])
def test_without_a_profile_a_gpu_node_splits_over_two_gpus_or_more(device, gpus, mode):
    config = NodeConfig(model="/m", mode="colocated", engine=EngineSettings(device=device, gpus=gpus))
    assert choose_mode(config, cores=64)[0] == mode


def test_a_node_of_a_cluster_or_of_one_role_keeps_its_workers_split():
    remote = NodeConfig(model="/m", controller=ControllerConfig(host="10.0.0.9", enabled=False))
    decode_only = NodeConfig(model="/m", prefill=WorkerGroup(count=0))
    assert remote.mode == decode_only.mode == "disaggregated"
    assert "cluster" in remote.mode_reason and "only" in decode_only.mode_reason
    assert NodeConfig(model="/m", mode="colocated").mode_reason == ""  # chosen by the operator: no reason given


@pytest.fixture(scope="module")
def measured_profile(model_dirs, tmp_path_factory):
    """The tiny model's profile on this host, measured once for the module."""
    return measure_profile(str(model_dirs["llama"]), threads=[1, 2], max_context=600, repeats=1).save(
        tmp_path_factory.mktemp("profile") / "measured.json")


@pytest.fixture
def profile(measured_profile, tmp_path):
    """A copy of it in this test's own directory, so that no test reads another's cached predictions."""
    path = tmp_path / "profile.json"
    shutil.copyfile(measured_profile, path)
    return path


def test_with_a_profile_the_mode_is_the_one_the_planner_predicts_serves_more(model_dirs, profile):
    config = NodeConfig(model=str(model_dirs["llama"]), mode="colocated")
    mode, why = choose_mode(config, profile, cores=2, seconds=2.0)  # few requests: the tiny model serves hundreds a s
    rates = dict(re.findall(r"(colocated|disaggregated) ([0-9.e+-]+) req/s", why))
    assert set(rates) == {"colocated", "disaggregated"} and str(profile) in why
    colocated, split = float(rates["colocated"]), float(rates["disaggregated"])
    if colocated != split:  # the reason shows 3 digits: rates equal there may still differ, either way
        assert mode == ("colocated" if colocated > split else "disaggregated")


def test_a_prediction_is_made_once_for_the_same_profile_slos_and_workers(model_dirs, profile):
    cache = profile.with_name("profile.modes.json")
    config = NodeConfig(model=str(model_dirs["llama"]), mode="colocated")
    choose_mode(config, profile, cores=2, seconds=2.0)
    assert len(json.loads(cache.read_text())) == 1
    cache.write_text(json.dumps({k: [2.0, 1.0] for k in json.loads(cache.read_text())}))  # a made-up prediction
    again = choose_mode(config, profile, cores=2, seconds=2.0)
    assert again[0] == "colocated" and "colocated 2 req/s, disaggregated 1 req/s" in again[1]  # read, not redone
    config.gateway.tpot_slo_s *= 2  # other SLOs: predicted anew
    other = choose_mode(config, profile, cores=2, seconds=2.0)
    assert "colocated 2 req/s" not in other[1] and len(json.loads(cache.read_text())) == 2
    cache.write_text("not json")  # a damaged cache is predicted over
    assert choose_mode(config, profile, cores=2, seconds=2.0) == other
