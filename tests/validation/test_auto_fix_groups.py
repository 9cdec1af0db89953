"""Auto-fix's search over groups of nodes (deploykit/validation/groups.py, auto_fix.py), issue 15 item 2.

The models are pre-LayerNorm residual streams of model_zoo (input scaled up, LayerNorm -> MLP blocks
added back, summed over 128 tokens): their fp16 error comes from many roundings of large values,
no single node diverges, and pinning single culprits found nothing to pin. The group search must
make them pass while pinning only cheap nodes (and, where an embedding and a head are in the
model, those short chains), and a graph whose error sits in its matrix products must still stop
with a clear message.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import pytest
import torch
import onnx
from onnx import helper

from deploykit.passes.precision import name_nodes
from deploykit.validation.auto_fix import HEADROOM, MAX_GROUP_SHARE, FixProblem, auto_fix
from deploykit.validation.compare import parse_tolerances
from deploykit.validation.layerwise import run_values
from deploykit_cli import convert, run_deploykit
from onnx_graphs import make_model, tensor

#: Ops without matrix work: what the high-magnitude path of these models may pin.
#: elementwise and normalising nodes: almost no multiply-adds. SkipLayerNormalization is ONNX Runtime's fusion
#: of a residual Add with the LayerNorm reading it (passes/ort_fusions.py): pinned, it is that Add in fp32.
CHEAP = {"Add", "Mul", "ReduceSum", "SkipLayerNormalization", "LayerNormalization"}


def fp16_convert(tmp_path, factory: str, *extra: str):
    torch.manual_seed(0)
    import model_zoo

    torch.save(getattr(model_zoo, factory)().state_dict(), tmp_path / "weights.pt")
    result = convert(tmp_path, "weights.pt", "--factory", f"model_zoo:{factory}", "--input", "x:1x128x32",
                     "--batch", "1:2:4", "--precision", "fp16", *extra, "-o", "bundle")
    return result, json.loads((tmp_path / "bundle" / "report.json").read_text())


def test_the_issues_model_fails_fp16_with_no_node_to_blame(tmp_path):
    """The premise: plain fp16 fails, yet no node output diverges on its own, so single culprits find nothing."""
    result, report = fp16_convert(tmp_path, "residual_stream")
    assert result.returncode == 1 and report["verdict"] == "fail", result.stderr
    layers = run_deploykit("debug", "bundle", "--layerwise", "--json", cwd=tmp_path, timeout=600)
    assert layers.returncode == 0, layers.stderr  # 0: nothing diverges
    assert not any(layer["diverged"] for layer in json.loads(layers.stdout)["layers"])
    fixed = run_deploykit("debug", "bundle", "--json", cwd=tmp_path, timeout=600)  # debug's fix finds the group too
    assert fixed.returncode == 0, fixed.stderr
    found = json.loads(fixed.stdout)
    assert found["passed"] and {p["op"] for p in found["pinned"]} <= CHEAP


@pytest.mark.parametrize("factory", ["residual_stream", pytest.param("residual_stream_2x30", marks=pytest.mark.slow),
                                     pytest.param("residual_stream_6x300", marks=pytest.mark.slow)])
def test_auto_fix_pins_only_cheap_nodes_of_the_residual_stream(tmp_path, factory):
    result, report = fp16_convert(tmp_path, factory, "--auto-fix")
    assert result.returncode == 0 and report["verdict"] == "pass", result.stderr
    fix = report["precision"]["auto_fix"]
    assert fix["passed"] and fix["stopped"] == "outputs pass"
    assert fix["pinned"] and {p["op"] for p in fix["pinned"]} <= CHEAP
    assert all(p["reason"].startswith(("high-magnitude path", "on a chain")) for p in fix["pinned"])
    assert sum(r["share_of_multiply_adds"] for r in fix["round_log"]) < 0.01  # the sum and fused residual norms
    check_rounds(fix)
    assert "auto-fix round 1 (high-magnitude path" in result.stderr
    page = (tmp_path / "bundle" / "report.html").read_text()
    assert "<th>error after (1 = tolerance)</th>" in page and "high-magnitude path" in page


def test_fused_residual_norms_keep_a_shallow_embedded_stream_in_range(tmp_path):
    """ONNX Runtime's SkipLayerNormalization adds the residual inside, in fp32: at 4 blocks of x30 no pin is needed."""
    result, report = fp16_convert(tmp_path, "embedded_residual_stream_4x30", "--auto-fix")
    assert result.returncode == 0 and report["verdict"] == "pass", result.stderr
    assert report["precision"]["auto_fix"] is None
    fused = report["ort_fusions"]["ops"]
    assert sum(n for op, n in fused.items() if op.endswith("SkipLayerNormalization")) == 3, fused  # blocks 2-4


def test_auto_fix_adds_the_short_chains_around_the_stream(tmp_path):
    """With an embedding before the scaling and a head after the sum, pinning the stream leaves two
    short fp16 chains (input -> embedding, sum -> head) whose rounding the stream amplifies: only
    those matrix products are pinned, none of the blocks' MLPs."""
    result, report = fp16_convert(tmp_path, "embedded_residual_stream_2x300", "--auto-fix")
    assert result.returncode == 0 and report["verdict"] == "pass", result.stderr
    fix = report["precision"]["auto_fix"]
    matrix = [p for p in fix["pinned"] if p["op"] not in CHEAP]
    assert matrix and all(p["reason"].startswith("on a chain of 1 fp16 node(s) between ") for p in matrix)
    assert {p["op"] for p in matrix} <= {"MatMul", "Gemm"}
    between = " ".join(p["reason"] for p in matrix)
    assert "input x" in between or "output output" in between  # the embedding or the head, not a block
    assert len(matrix) <= 2 and fix["tradeoff"]["fp32_share_of_multiply_adds"] < 0.15
    check_rounds(fix)


def check_rounds(fix: dict) -> None:
    """Every round says what it pinned, why, its cost and the error after; groups tried cheapest first."""
    assert fix["rounds"] == len(fix["round_log"]) >= 1
    pinned = [p["node"] for p in fix["pinned"]]
    assert [n for r in fix["round_log"] for n in r["nodes"]] == pinned
    for entry in fix["round_log"]:
        assert entry["why"] and entry["kind"] in ("high-magnitude path", "chains between fp32 nodes",
                                                  "high-magnitude path and chains")
        assert entry["multiply_adds"] >= len(entry["nodes"]) and entry["error_after"] is not None
        costs = [t["multiply_adds"] for t in entry["tried"]]
        assert costs == sorted(costs) and entry["tried"][-1]["nodes"] == entry["nodes"]
    last = fix["round_log"][-1]
    assert last["passed"] and last["error_after"] <= HEADROOM


# --- a graph no cheap group can fix -------------------------------------------------------------


def matrix_stack(layers: int = 4, width: int = 64) -> FixProblem:
    """``layers`` MatMuls of equal cost under a tolerance fp16 matrix products cannot meet (atol = rtol
    = 1e-4): no node diverges at fp16's default tolerance, and any fix within half the multiply-adds
    leaves too many of them fp16."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"], name=f"matmul{i}"))
        inits.append(tensor(f"w{i}", rng.normal(0, 1 / np.sqrt(width), (width, width))))
        x = f"h{i}"
    nodes.append(helper.make_node("Identity", [x], ["y"], name="out"))
    model = name_nodes(make_model(nodes, inits, {"x": ["N", width]}, {"y": 2}))
    feeds = {"x": rng.standard_normal((8, width)).astype(np.float32)}
    return FixProblem(model, "fp16", None, {}, feeds, {"y": run_values(model, feeds)["y"]},
                      parse_tolerances(["atol=1e-4,rtol=1e-4"], "fp16", ["y"]))


def test_a_graph_whose_error_is_in_its_matrix_products_stops_with_a_clear_message():
    fix = auto_fix(matrix_stack())
    assert not fix.passed and fix.failures
    assert fix.stopped.startswith("no further node to pin: no single node diverges, and ")
    assert "would pin over 50% of the multiply-adds" in fix.stopped  # the group that lowered the error took half
    assert "keep --precision fp32, or loosen --tolerance" in fix.stopped
    assert fix.round_log and not fix.round_log[-1].passed and fix.round_log[-1].error_after > 1
    assert fix.tradeoff["fp32_share_of_multiply_adds"] <= MAX_GROUP_SHARE + 0.01
    assert all(r.share_of_multiply_adds <= MAX_GROUP_SHARE for r in fix.round_log)


# --- the candidates, on a hand-built graph ----------------------------------------------------------


def test_candidate_groups_come_cheapest_first_and_say_why():
    """x -> Mul(x300) -> MatMul -> ReduceSum(8 tokens) -> y: the Mul is fp32 (the side of fewer casts),
    the path groups rank the fp16 nodes by value, the cheap ones leave the MatMul out, and the two
    fp16 nodes are one chain from the Mul to output y."""
    import onnx_ir as ir

    from deploykit.passes.precision import apply_precision
    from deploykit.validation.groups import CHAIN, PATH, candidate_groups

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Mul", ["x", "scale"], ["big"], name="scale_up"),
             helper.make_node("MatMul", ["big", "w"], ["h"], name="matmul"),
             helper.make_node("ReduceSum", ["h", "axis"], ["y"], name="sum", keepdims=0)]
    inits = [tensor("scale", np.array(300.0)), tensor("w", rng.normal(0, 0.2, (16, 16))),
             onnx.numpy_helper.from_array(np.array([1], dtype=np.int64), "axis")]
    model = name_nodes(make_model(nodes, inits, {"x": ["N", 8, 16]}, {"y": 2}))
    feeds = {"x": rng.standard_normal((2, 8, 16)).astype(np.float32)}
    values = run_values(model, feeds)
    typed = apply_precision(model, "fp16")
    assert {n.node for n in typed.nodes if n.precision == "fp16"} == {"matmul", "sum"}
    names = {n.name for n in model.graph.node}
    graph = ir.serde.deserialize_graph(typed.model.graph)

    def retype(pinned):
        return ir.serde.deserialize_graph(apply_precision(model, "fp16", keep_fp32=dict.fromkeys(pinned, "x"))
                                          .model.graph)

    magnitudes = {k: float(np.abs(v).max()) for k, v in values.items()}
    shapes = {k: v.shape for k, v in values.items()}
    groups = candidate_groups(graph, retype, magnitudes, shapes, names, "fp16", budget=1e9)
    costs = [g.cost for g in groups]
    assert costs == sorted(costs) and len({frozenset(g.nodes) for g in groups}) == len(groups)
    first = groups[0]
    assert first.kind == PATH and list(first.nodes) == ["sum"] and "(no matrix work)" in first.why
    assert "fp16 steps by" in first.nodes["sum"]
    whole = next(g for g in groups if g.kind == CHAIN)
    assert set(whole.nodes) == {"matmul", "sum"} and "between scale_up and output y" in whole.why
    # the sum with the chain it leaves (the MatMul) is the chain again: kept once
    assert [set(g.nodes) for g in groups] == [{"sum"}, {"matmul", "sum"}]
    assert not candidate_groups(graph, retype, magnitudes, shapes, names, "fp16", budget=0)


# --- what auto-fix runs -------------------------------------------------------------------------------


def test_each_trial_runs_every_feed_set_in_one_session(monkeypatch):
    """A trial types the graph once and runs the failing inputs and the others in one ONNX Runtime
    session; the fp32 graph runs once, and not at all when the caller has its values."""
    from deploykit.validation import auto_fix as fixing
    from deploykit.validation import layerwise

    problem = matrix_stack()
    rng = np.random.default_rng(1)
    for rows in (2, 4):
        feeds = {"x": rng.standard_normal((rows, 64)).astype(np.float32)}
        problem.others.append((feeds, {"y": run_values(problem.fp32, feeds)["y"]}))
    sessions, trials, runs = [], [], []
    create, try_ = layerwise.loader.create_session, fixing._Search._try

    def counted_session(*args, **kwargs):
        session = create(*args, **kwargs)
        sessions.append(session)
        return session

    monkeypatch.setattr(layerwise.loader, "create_session", counted_session)
    monkeypatch.setattr(fixing._Search, "_try", lambda search, pins: trials.append(pins) or try_(search, pins))
    monkeypatch.setattr(fixing, "emulate", lambda model, emulate=fixing.emulate: runs.append(model) or emulate(model))
    auto_fix(problem)
    assert trials and len(sessions) == len(trials) + 1 == len(runs) + 1  # the + 1: the fp32 graph's values
    sessions.clear()
    trials.clear()
    auto_fix(dataclasses.replace(problem, fp32_values=run_values(problem.fp32, problem.feeds)))
    assert len(sessions) == len(trials) + 1  # the + 1: run_values just above


def test_a_conversion_with_auto_fix_runs_pytorch_once_per_feed_set(monkeypatch, tmp_path):
    """Validation, auto-fix (each round and the TensorRT graph's too) and the validation after it
    compare with one PyTorch run of each feed set, in fp32 and in float64."""
    import model_zoo
    from deploykit.backends.torch.runner import TorchRunner
    from deploykit.conversion.options import ConvertOptions
    from deploykit.conversion.pipeline import convert as convert_in_process
    from deploykit.specs import BatchRange, InputSpec

    torch.manual_seed(0)
    torch.save(model_zoo.residual_stream_2x30().state_dict(), tmp_path / "weights.pt")
    runs, run = [], TorchRunner.run

    def counted(runner, feeds=None, /, **named):
        runs.append((runner.float_type, *(hashlib.sha256(array.tobytes()).hexdigest() for array in feeds.values())))
        return run(runner, feeds, **named)

    monkeypatch.setattr(TorchRunner, "run", counted)
    options = ConvertOptions(tmp_path / "weights.pt", tmp_path / "bundle", [InputSpec("x", (1, 128, 32), "float32")],
                             batch=BatchRange(1, 2, 4), factory="model_zoo:residual_stream_2x30", precision="fp16",
                             auto_fix=True)
    result = convert_in_process(options)
    assert result.passed and result.report["precision"]["auto_fix"]["rounds"] >= 1
    assert len(runs) > 3 and len(set(runs)) == len(runs)
