"""Profile JSON, layer graph and stage graph."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeoptim.errors import PlanError
from pipeoptim.plan.graph import (
    layer_graph,
    stage_graph,
    stage_graph_from_dict,
    stage_graph_to_dict,
    stage_memory_bytes,
    validate_boundaries,
)
from pipeoptim.plan.profile import LayerProfile, Profile, optimizer_state_factor


def small_profile() -> Profile:
    return Profile.from_costs(
        forward_s=[0.1, 0.2, 0.3, 0.4],
        backward_s=[0.2, 0.4, 0.6, 0.8],
        activation_bytes=[100, 200, 300, 400],
        param_bytes=[1000, 0, 3000, 4000],
        optimizer="adam",
        batch_size=8,
        names=["embed", "relu", "block", "head"],
        meta={"note": "test"},
    )


# ------------------------------------------------------------------------ profile
def test_from_costs_fills_state_and_counts() -> None:
    p = small_profile()
    assert p.num_layers == 4
    assert p.layers[0] == LayerProfile("embed", 0.1, 0.2, 100, 1000, 2000, 250)
    assert p.total_param_bytes == 8000
    assert p.total_optimizer_state_bytes == 16000
    assert p.total_activation_bytes == 1000
    assert p.total_param_count == 2000
    assert p.total_forward_s == pytest.approx(1.0)
    assert p.total_backward_s == pytest.approx(2.0)
    assert p.total_compute_s == pytest.approx(3.0)


def test_uniform() -> None:
    p = Profile.uniform(5, 1.0, 2.0, activation_bytes=10, param_bytes=40, optimizer="sgd")
    assert p.num_layers == 5
    assert {layer.optimizer_state_bytes for layer in p.layers} == {40}
    assert {layer.param_count for layer in p.layers} == {10}
    assert p.total_compute_s == 15.0
    q = Profile.uniform(2, param_bytes=8, optimizer_state_bytes=0)
    assert q.total_optimizer_state_bytes == 0
    with pytest.raises(PlanError, match="num_layers >= 1"):
        Profile.uniform(0)


def test_optimizer_state_factor() -> None:
    assert optimizer_state_factor("sgd") == 1
    assert optimizer_state_factor("sgd", momentum=False) == 0
    assert optimizer_state_factor("Adam") == 2
    assert optimizer_state_factor("adamw") == 2
    assert optimizer_state_factor("rmsprop") == 1
    assert optimizer_state_factor("rmsprop", momentum=True) == 2
    assert optimizer_state_factor("nadam") == 2
    assert optimizer_state_factor("muon") == 1
    assert optimizer_state_factor("basis-rotation") == 6  # a square matrix's m, v, L, R, Q_L, Q_R
    with pytest.raises(
        PlanError, match=r"adagrad.*adam, adamw, basis-rotation, muon, nadam, rmsprop, sgd"
    ):
        optimizer_state_factor("adagrad")


def test_profile_json_round_trip(tmp_path: Path) -> None:
    p = small_profile()
    path = tmp_path / "profile.json"
    p.save(path)
    data = json.loads(path.read_text())
    assert data["version"] == 1
    assert data["format"] == "pipeoptim.profile"
    q = Profile.load(path)
    assert q == p
    assert Profile.from_json(p.to_json()) == p


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "is empty"),
        ("   \n", "is empty"),
        ("{", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"version": 1, "batch_size": 1, "optimizer": "sgd", "device": "x"}', "'layers'"),
        ('{"batch_size": 1}', "'version'"),
        ('{"version": 99, "layers": []}', "version 99"),
        (
            '{"version": 1, "batch_size": 1, "optimizer": "sgd", "device": "x", "layers": []}',
            "at least one layer",
        ),
    ],
)
def test_profile_malformed(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(PlanError, match=needle) as info:
        Profile.load(path)
    assert "bad.json" in str(info.value)


def test_profile_missing_layer_key_is_named() -> None:
    data = small_profile().to_dict()
    del data["layers"][2]["backward_s"]
    with pytest.raises(PlanError, match=r"layers\[2\] is missing the key 'backward_s'"):
        Profile.from_dict(data)
    data = small_profile().to_dict()
    data["layers"][1]["forward_s"] = -1.0
    with pytest.raises(PlanError, match=r"layers\[1\].*forward_s.*>= 0"):
        Profile.from_dict(data)
    data = small_profile().to_dict()
    data["layers"][0]["param_bytes"] = "lots"
    with pytest.raises(PlanError, match="param_bytes must be a whole number"):
        Profile.from_dict(data)


def test_profile_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="does not exist"):
        Profile.load(tmp_path / "nope.json")


# ------------------------------------------------------------------------ graphs
def test_layer_graph_attributes() -> None:
    p = small_profile()
    g = layer_graph(p)
    assert list(g.nodes) == [0, 1, 2, 3]
    assert list(g.edges) == [(0, 1), (1, 2), (2, 3)]
    assert g.nodes[2] == {
        "name": "block",
        "forward_s": 0.3,
        "backward_s": 0.6,
        "activation_bytes": 300,
        "param_bytes": 3000,
        "optimizer_state_bytes": 6000,
        "param_count": 750,
    }
    assert [g.edges[e]["bytes"] for e in g.edges] == [100, 200, 300]
    assert g.graph["batch_size"] == 8
    assert g.graph["optimizer"] == "adam"


def test_stage_graph_attributes() -> None:
    p = small_profile()
    g = stage_graph(p, [(0, 1), (1, 3), (3, 4)], weight_copies=[3, 2, 1], activation_slots=2)
    assert list(g.edges) == [(0, 1), (1, 2)]
    mid = g.nodes[1]
    assert mid["start"] == 1 and mid["end"] == 3
    assert mid["layers"] == [1, 2]
    assert mid["layer_names"] == ["relu", "block"]
    assert mid["forward_s"] == pytest.approx(0.5)
    assert mid["backward_s"] == pytest.approx(1.0)
    assert mid["param_bytes"] == 3000
    assert mid["grad_bytes"] == 3000
    assert mid["optimizer_state_bytes"] == 6000
    assert mid["activation_bytes"] == 500
    assert mid["weight_copies"] == 2
    assert mid["activation_slots"] == 2
    # 2 copies + grads + adam state + 2 slots of activations
    assert mid["memory_bytes"] == 2 * 3000 + 3000 + 6000 + 2 * 500
    assert g.nodes[0]["memory_bytes"] == 3 * 1000 + 1000 + 2000 + 2 * 100
    assert g.edges[0, 1]["bytes"] == 100  # output of layer 0
    assert g.edges[1, 2]["bytes"] == 300  # output of layer 2
    assert stage_memory_bytes(10, 20, 5, 2, 3) == 2 * 10 + 10 + 20 + 3 * 5


def test_stage_graph_dict_round_trip() -> None:
    p = small_profile()
    g = stage_graph(p, [(0, 2), (2, 4)], weight_copies=[2, 1], activation_slots=[2, 1])
    data = json.loads(json.dumps(stage_graph_to_dict(g)))
    h = stage_graph_from_dict(data)
    assert list(h.nodes(data=True)) == list(g.nodes(data=True))
    assert list(h.edges(data=True)) == list(g.edges(data=True))
    assert h.graph == g.graph
    del data["stages"][1]["memory_bytes"]
    with pytest.raises(PlanError, match=r"stages\[1\] is missing the key 'memory_bytes'"):
        stage_graph_from_dict(data)
    with pytest.raises(PlanError, match="missing the key 'stages'"):
        stage_graph_from_dict({"version": 1, "graph": {}, "edges": []})


@pytest.mark.parametrize(
    ("bounds", "needle"),
    [
        ([], "no stages"),
        ([(0, 2), (3, 4)], "stage 1 starts at layer 3 but the previous stage ends at 2"),
        ([(0, 2), (2, 2), (2, 4)], "stage 1 is empty"),
        ([(0, 3)], "end at layer 3 but the profile has 4 layers"),
        ([(1, 4)], "stage 0 starts at layer 1"),
        ([(0, 4, 5)], "stage 0 has boundary"),
    ],
)
def test_validate_boundaries_errors(bounds: list[tuple[int, int]], needle: str) -> None:
    with pytest.raises(PlanError, match=needle):
        validate_boundaries(bounds, 4)


def test_stage_graph_factor_length_error() -> None:
    with pytest.raises(PlanError, match="one value per stage: got 3 values for 2 stages"):
        stage_graph(small_profile(), [(0, 2), (2, 4)], weight_copies=[1, 1, 1])


def test_plan_core_does_not_import_torch() -> None:
    code = (
        "import sys, pipeoptim.plan.partition, pipeoptim.plan.graph, pipeoptim.plan.profile, "
        "pipeoptim.plan.units; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prediction_setup_is_kept_where_measured_and_left_out_where_not(tmp_path: Path) -> None:
    """``prediction_setup_s`` round-trips through the file and sums per stage; a layer
    without it is written as older files were (no key), so their digests and stage graphs
    stay as they were."""
    base = Profile.uniform(3, optimizer="muon")
    assert all("prediction_setup_s" not in x for x in base.to_dict()["layers"])
    assert "prediction_setup_s" not in stage_graph(base, [(0, 2), (2, 3)]).nodes[0]
    timed = dataclasses.replace(
        base,
        layers=tuple(dataclasses.replace(x, prediction_setup_s=0.25) for x in base.layers),
    )
    path = tmp_path / "profile.json"
    timed.save(path)
    assert Profile.load(path) == timed
    graph = stage_graph(timed, [(0, 2), (2, 3)])
    assert [graph.nodes[k]["prediction_setup_s"] for k in (0, 1)] == [0.5, 0.25]
    with pytest.raises(PlanError, match="prediction_setup_s"):
        dataclasses.replace(base.layers[0], prediction_setup_s=-1.0)
