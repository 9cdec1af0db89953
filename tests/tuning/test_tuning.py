"""Tuning on the CPU: ``deploykit tune`` and ``convert --tune`` write a table that the schema
checks, ``deploykit.load(backend="auto")`` routes by it (or ignores it, saying why), and bench
times torch.compile(mode="reduce-overhead") and the default runner beside the rest.

Bundles come from ``converted_bundles`` (model_zoo's tabular net, batch 1:2:4); each test that
changes one works on a copy.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import deploykit
from deploykit import runtime
from deploykit.errors import BadInputError
from deploykit.tuning import record
from deploykit.tuning.checking import graph_reference, source_reference
from deploykit.tuning.route import Route, TunedRunner
from deploykit.tuning.tune import TuneSettings, tune_bundle
from converted_bundles import copy_bundle, edit_manifest
from deploykit_cli import run_deploykit

FAST = ["--iterations", "3", "--warmup", "1"]


def cli(*args) -> subprocess.CompletedProcess:
    return run_deploykit(*args, columns=200, timeout=600)


def source_of(bundle: Path) -> str:
    return json.loads((bundle / "manifest.json").read_text())["source"]


@pytest.fixture(scope="module")
def tuned_once(tmp_path_factory) -> Path:
    """The tabular bundle tuned on this CPU against its source model, through the CLI (once per module:
    a tune takes about 10 s on 2 cores)."""
    bundle = copy_bundle("tabular", tmp_path_factory.mktemp("tuned"))
    result = cli("tune", bundle, "--factory", "model_zoo:tabular", "--device", "cpu", *FAST)
    assert result.returncode == 0, result.stderr
    return bundle


@pytest.fixture
def tuned(tuned_once, tmp_path) -> Path:
    """A copy of the tuned bundle that a test may change."""
    return Path(shutil.copytree(tuned_once, tmp_path / tuned_once.name))


def features(batch: int) -> np.ndarray:
    return np.random.default_rng(batch).standard_normal((batch, 13), dtype=np.float32)


# --------------------------------------------------------------------------- the table


def test_tune_records_the_fastest_passing_candidate_per_batch_size(tuned):
    manifest = json.loads((tuned / "manifest.json").read_text())
    table = manifest["tuning"]
    assert (table["device"], table["gpu"], table["cuda_arch"]) == ("cpu", None, None)
    assert table["reference"] == "source PyTorch model (fp32, CPU)"
    assert [choice["batch"] for choice in table["choices"]] == [1, 2, 4]  # the validated sizes
    for choice in table["choices"]:
        [chosen] = [c for c in choice["candidates"] if c["chosen"]]
        assert chosen["passed"] and chosen["max_abs"] < 1e-4 and choice["p50_ms"] == chosen["p50_ms"] > 0
        assert (choice["backend"], choice["options"]) == (chosen["backend"], chosen["options"]) == ("onnxruntime", {})
    assert table["versions"]["onnxruntime"] and not table["unchosen"]


def test_the_table_round_trips_and_the_files_stay_verified(tuned, tmp_path):
    before = json.loads((copy_bundle("tabular", tmp_path / "fresh") / "manifest.json").read_text())
    after = runtime.open_bundle(tuned)  # checked against the schema
    assert after.file_problems() == {}
    unchanged = {name: entry for name, entry in before["files"].items() if not name.startswith("report.")}
    assert {name: after.manifest["files"][name] for name in unchanged} == unchanged
    report = json.loads((tuned / "report.json").read_text())
    assert report["tuning"] == after.manifest["tuning"]
    page = (tuned / "report.html").read_text()
    assert page.count("<h2>Tuning</h2>") == 1 and "ONNX Runtime, CPU" in page
    record.write_tuning(tuned, after.manifest["tuning"])  # again: the section is replaced, not added
    assert (tuned / "report.html").read_text().count("<h2>Tuning</h2>") == 1
    assert runtime.open_bundle(tuned).file_problems() == {}


@pytest.mark.parametrize(("change", "field"), [
    (lambda t: t["choices"][0].update(backend="directml"), "tuning.choices.0.backend"),
    (lambda t: t["choices"][0].update(batch=0), "tuning.choices.0.batch"),
    (lambda t: t.update(device="tpu"), "tuning.device"),
    (lambda t: t["choices"][0].pop("p50_ms"), "tuning.choices.0.p50_ms"),
])
def test_a_damaged_table_is_refused_by_the_schema(tuned, change, field):
    edit_manifest(tuned, lambda m: change(m["tuning"]))
    with pytest.raises(BadInputError, match=field.replace(".", r"\.")):
        runtime.open_bundle(tuned)


def test_without_the_source_model_the_bundles_graph_is_the_reference(tmp_path):
    bundle = copy_bundle("tabular", tmp_path)
    edit_manifest(bundle, lambda m: m.update(source=str(tmp_path / "gone.pt")))
    result = cli("tune", bundle, "--device", "cpu", "--batch", "3", "--json", *FAST)
    assert result.returncode == 0, result.stderr
    table = json.loads(result.stdout)
    assert table["reference"] == "model.onnx on ONNX Runtime, CPU (no source model)"
    assert "gone.pt" in table["notes"][0] and [c["batch"] for c in table["choices"]] == [3]
    assert runtime.open_bundle(bundle).manifest["tuning"] == table


@pytest.mark.parametrize("batch", ["0", "two", "1,,-3"])
def test_bad_batch_is_a_usage_error(tmp_path, batch):
    bundle = copy_bundle("tabular", tmp_path)
    result = cli("tune", bundle, "--batch", batch, "--device", "cpu")
    assert result.returncode == 2 and "--batch" in result.stderr and "1,8,32" in result.stderr
    assert "tuning" not in json.loads((bundle / "manifest.json").read_text())


def test_tuning_on_a_gpu_this_machine_lacks_is_an_environment_problem(tmp_path):
    if runtime.has_gpu():
        pytest.skip("this machine has a GPU")
    bundle = copy_bundle("tabular", tmp_path)
    result = cli("tune", bundle, "--device", "cuda", *FAST)
    assert result.returncode == 3 and "cannot tune on cuda:0" in result.stderr and "--device cpu" in result.stderr


def test_a_wrong_candidate_fails_its_check_and_is_not_chosen(tmp_path):
    """Checked against a model other than the bundle's: every candidate is timed, none passes."""
    import model_zoo
    import torch

    from deploykit.conversion.loading import LoadedModel

    bundle = runtime.open_bundle(copy_bundle("tabular", tmp_path))
    torch.manual_seed(7)
    other = LoadedModel(model_zoo.tabular().eval(), "module", Path("other.pt"), ["features"])
    table = tune_bundle(bundle, other, TuneSettings(warmup=0, iterations=3), [2])
    assert table["choices"] == [] and len(table["unchosen"]) == 1
    found = table["unchosen"][0]["candidates"]
    [candidate] = [c for c in found if c["backend"] == "onnxruntime"]
    assert all("GPU only" in c["reason"] and c["p50_ms"] is None for c in found if c["backend"] == "tensorrt")
    assert not candidate["passed"] and candidate["p50_ms"] > 0 and "exceeds" in candidate["reason"]


def test_candidates_are_judged_by_the_bundles_recorded_tolerances_then_tunes(tmp_path):
    """The conversion's --tolerance (in the manifest) applies, and tune's own --tolerance after it."""
    bundle = copy_bundle("tabular", tmp_path)
    edit_manifest(bundle, lambda m: m["validation"].update(tolerances=["atol=0,rtol=0,min_cosine=1"]))
    args = ["tune", bundle, "--factory", "model_zoo:tabular", "--device", "cpu", "--batch", "2", "--json", *FAST]
    strict = cli(*args)
    assert strict.returncode == 0, strict.stderr
    assert json.loads(strict.stdout)["choices"] == []  # no candidate is bit-exact to PyTorch
    loosened = cli(*args, "--tolerance", "atol=1e-4,rtol=1e-3,min_cosine=0.99999")
    assert loosened.returncode == 0, loosened.stderr
    assert [choice["batch"] for choice in json.loads(loosened.stdout)["choices"]] == [2]


# --------------------------------------------------------------------------- load


def test_load_routes_by_the_table(tuned):
    runner = deploykit.load(tuned)
    assert isinstance(runner, TunedRunner) and runner.backend == "tuned"
    assert any(note.startswith("tuned: batch 1 -> onnxruntime") for note in runner.notes)
    plain = deploykit.load(tuned, backend="onnxruntime")  # an explicit backend wins over the table
    assert type(plain).__name__ == "OnnxRuntimeRunner"
    for batch in (1, 3, 4):
        expected = plain(features=features(batch))
        for given in (runner(features=features(batch)), runner(features(batch)), runner({"features": features(batch)})):
            for name, value in given.items():
                np.testing.assert_allclose(value, expected[name], rtol=1e-6, atol=1e-6)
    with pytest.raises(BadInputError, match="no input named wrong"):
        runner(wrong=features(1))


def test_user_onnxruntime_options_still_apply(tuned):
    runner = deploykit.load(tuned, threads=1)
    assert isinstance(runner, TunedRunner)
    [sub] = runner.runners()
    assert sub.session.get_session_options().intra_op_num_threads == 1


def test_tuning_from_another_machine_is_ignored_with_a_note(tuned):
    edit_manifest(tuned, lambda m: m["tuning"].update(device="cuda", gpu="NVIDIA Other GPU", cuda_arch="8.0"))
    runner = deploykit.load(tuned, device="cpu")
    assert not isinstance(runner, TunedRunner)
    assert "tuning not used: it was tuned on cuda, this runs on cpu" in runner.notes


def test_mismatch_names_the_gpu():
    tuning = {"device": "cuda", "gpu": "NVIDIA H200", "cuda_arch": "9.0"}
    assert record.mismatch(tuning, dict(tuning)) is None
    assert record.mismatch(tuning, {**tuning, "gpu": "NVIDIA A100"}) == \
        "it was tuned on GPU NVIDIA H200, this is NVIDIA A100"
    assert "compute capability 9.0" in record.mismatch(tuning, {**tuning, "cuda_arch": "8.0"})


def test_a_choice_that_cannot_run_here_gives_way_to_onnxruntime(tuned):
    def engine_choice(manifest):
        manifest["tuning"]["choices"][0].update(backend="tensorrt", options={"file": "model.fp32.sm90.engine"})

    edit_manifest(tuned, engine_choice)
    runner = deploykit.load(tuned)
    assert isinstance(runner, TunedRunner)
    assert any(note.startswith("batch 1: the tuned tensorrt does not run here") and "ONNX Runtime instead" in note
               for note in runner.notes)
    assert runner.runner_for(1).backend == "onnxruntime"


def test_routing_exact_then_nearest_above_then_below(tuned):
    bundle = runtime.open_bundle(tuned)
    small, large, anywhere = (runtime.load_onnxruntime(bundle) for _ in range(3))
    narrow = runtime.load_onnxruntime(bundle)  # stands in for a static package: it takes batch 4 only
    routes = [Route(1, small, None, "small"), Route(2, large, None, "large"), Route(4, narrow, [(4, 4)], "static")]
    runner = TunedRunner(bundle, "cpu", routes, anywhere, [])
    assert runner.runner_for(1) is small and runner.runner_for(2) is large and runner.runner_for(4) is narrow
    assert runner.runner_for(3) is large  # no route above takes 3: the nearest below
    routes = [Route(2, small, None, "a"), Route(8, large, None, "b")]
    runner = TunedRunner(bundle, "cpu", routes, None, [])
    assert runner.runner_for(1) is small and runner.runner_for(3) is large and runner.runner_for(9) is large
    routes = [Route(4, narrow, [(4, 4)], "static")]
    assert TunedRunner(bundle, "cpu", routes, anywhere, []).runner_for(3) is anywhere


def test_the_references(tmp_path):
    import model_zoo

    from deploykit.conversion.loading import load_model

    bundle = runtime.open_bundle(copy_bundle("tabular", tmp_path))
    feeds = runtime.random_inputs(bundle.inputs, 2)
    by_graph = graph_reference(bundle).runner.run(feeds)
    loaded = load_model(Path(source_of(bundle.path)), "model_zoo:tabular", False)
    assert model_zoo  # the factory's module is importable here
    by_source = source_reference(loaded, bundle).runner.run(feeds)
    assert set(by_graph) == set(by_source) == {spec["name"] for spec in bundle.outputs}
    for name in by_graph:
        np.testing.assert_allclose(by_graph[name], by_source[name], rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- convert --tune and inspect


def test_convert_tune_records_the_table_and_inspect_shows_it(tmp_path):
    result = cli("convert", source_of(copy_bundle("tabular", tmp_path)), "--factory", "model_zoo:tabular",
                 "--input", "features:1x13", "--batch", "1:2:4", "-o", tmp_path / "tuned", "--tune")
    assert result.returncode == 0, result.stderr
    assert "tuning on cpu" in result.stderr and "chosen" in result.stderr
    bundle = runtime.open_bundle(tmp_path / "tuned")
    table = bundle.manifest["tuning"]
    assert table["reference"] == "the PyTorch model (fp32, CPU) as validated"
    assert [c["batch"] for c in table["choices"]] == [1, 2, 4] and bundle.file_problems() == {}
    assert json.loads((bundle.path / "report.json").read_text())["tuning"] == table
    shown = cli("inspect", bundle.path)
    printed = shown.stdout + shown.stderr
    assert shown.returncode == 0 and "tuning on cpu" in printed and "ONNX Runtime, CPU" in printed
    assert json.loads(cli("inspect", bundle.path, "--json").stdout)["tuning"] == table


def test_convert_without_tune_leaves_an_empty_section(tmp_path):
    bundle = copy_bundle("tabular", tmp_path)
    assert "tuning" not in json.loads((bundle / "manifest.json").read_text())
    page = (bundle / "report.html").read_text()
    assert "<!-- tuning --><!-- /tuning -->" in page.replace("\n", "")


# --------------------------------------------------------------------------- bench


def test_bench_times_reduce_overhead_and_the_default_runner(tmp_path, tuned):
    result = cli("bench", tuned, "--model", source_of(tuned), "--factory", "model_zoo:tabular", "--device", "cpu",
                 "--batch", "2", "--only", "reduce-overhead,ort-deploykit,aoti-static,aoti-dynamic,deploykit-load",
                 "--json", "-o", tmp_path, *FAST)
    assert result.returncode == 0, result.stderr
    entries = {e["key"]: e for e in json.loads(result.stdout)["contenders"]}
    assert entries["reduce-overhead"]["status"] == "ok", entries["reduce-overhead"]["reason"]
    assert "CPU: no CUDA graphs" in entries["reduce-overhead"]["label"]
    assert entries["deploykit-load"]["status"] == "ok", entries["deploykit-load"]["reason"]
    for kind in ("static", "dynamic"):
        assert "no AOTInductor package" in entries[f"aoti-{kind}"]["reason"]
    [baseline] = entries["reduce-overhead"]["results"]
    assert baseline["vs_reduce_overhead"] == 1.0
    for key in ("ort-deploykit", "deploykit-load"):
        [row] = entries[key]["results"]
        assert row["vs_reduce_overhead"] == pytest.approx(row["p50_ms"] / baseline["p50_ms"])


# --------------------------------------------------------------------------- AOTInductor packages
# Marked slow (make test-slow): the packages' build and their tuning take a minute on 2 cores; make test
# covers the packages themselves in tests/backends/test_aoti.py.


@pytest.fixture(scope="module")
def aoti_bundle(tmp_path_factory) -> Path:
    """tiny_conv with static and dynamic CPU AOTI packages (batch 1:2:4), tuned through the CLI."""
    from converted_bundles import converted_aoti

    bundle = Path(shutil.copytree(converted_aoti(), tmp_path_factory.mktemp("aoti") / "bundle"))
    result = cli("tune", bundle, "--factory", "model_zoo:tiny_conv", "--device", "cpu", "--batch", "1,2,3", *FAST)
    assert result.returncode == 0, result.stderr
    return bundle


@pytest.mark.slow
def test_tune_times_the_aoti_packages(aoti_bundle):
    table = runtime.open_bundle(aoti_bundle).manifest["tuning"]
    assert [c["batch"] for c in table["choices"]] == [1, 2, 3]
    by_batch = {c["batch"]: {k["label"].split(" (")[0]: k for k in c["candidates"]} for c in table["choices"]}
    for batch in (1, 2, 3):
        dynamic = by_batch[batch]["AOTInductor dynamic"]
        assert dynamic["passed"] and dynamic["p50_ms"] > 0 and dynamic["options"] == {"packages": "dynamic",
                                                                                         "cuda_graph": False}
    assert by_batch[2]["AOTInductor static"]["passed"] and by_batch[2]["AOTInductor static"]["p50_ms"] > 0
    static_at_3 = by_batch[3]["AOTInductor static"]  # compiled for 1, 2 and 4 only
    assert static_at_3["p50_ms"] is None and static_at_3["reason"] == "it takes batch sizes 1, 2, 4"


@pytest.mark.slow
def test_load_routes_to_aoti_choices_and_matches_onnxruntime(aoti_bundle, tmp_path):
    bundle = Path(shutil.copytree(aoti_bundle, tmp_path / "bundle"))

    def prefer_static(manifest):  # whatever was fastest here, route batch 2 to the static packages
        manifest["tuning"]["choices"][1].update(backend="aoti", options={"packages": "static", "cuda_graph": False})

    edit_manifest(bundle, prefer_static)
    runner = deploykit.load(bundle)
    assert isinstance(runner, TunedRunner) and runner.runner_for(2).backend == "aoti"
    spinning_stopped = deploykit.load(bundle, spin=False)  # serve's CPU option: it moves no route to ONNX Runtime
    assert spinning_stopped.runner_for(2).backend == "aoti"
    assert {r.session.get_session_options().get_session_config_entry("session.force_spinning_stop")
            for r in spinning_stopped.runners() if r.backend == "onnxruntime"} == {"1"}
    plain = deploykit.load(bundle, backend="onnxruntime")
    for batch in (1, 2, 3, 4):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 8, 8), dtype=np.float32)
        expected = plain(x=x)
        for name, value in runner(x=x).items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_static_packages_run_where_onnxruntime_cannot(aoti_bundle, tmp_path, monkeypatch):
    """On a GPU machine with AOTInductor but no onnxruntime-gpu, the sizes the packages take run
    and the others are refused with the reason, instead of the whole load failing."""
    from deploykit.errors import EnvironmentProblem
    from deploykit.tuning import route

    bundle = Path(shutil.copytree(aoti_bundle, tmp_path / "bundle"))

    def all_static(manifest):
        for choice in manifest["tuning"]["choices"]:
            choice.update(backend="aoti", options={"packages": "static", "cuda_graph": False})

    edit_manifest(bundle, all_static)
    opened = route.open_runner

    def no_onnxruntime(bundle, backend, options, *args, **kwargs):
        if backend == "onnxruntime":
            raise EnvironmentProblem("onnxruntime's CUDAExecutionProvider did not start")
        return opened(bundle, backend, options, *args, **kwargs)

    monkeypatch.setattr(route, "open_runner", no_onnxruntime)
    runner = deploykit.load(bundle)
    assert isinstance(runner, TunedRunner)
    assert any(note.startswith("batches other than 1, 2, 4 are refused") for note in runner.notes)
    for batch in (1, 2, 4):
        x = np.zeros((batch, 3, 8, 8), np.float32)
        assert runner(x=x)[runner.output_names[0]].shape[0] == batch
    with pytest.raises(BadInputError, match=r"batch 3: the tuned runners here take batch 1, 2, 4 only.*"
                                            r"CUDAExecutionProvider did not start.*pad to a size they take"):
        runner(x=np.zeros((3, 3, 8, 8), np.float32))


@pytest.mark.slow
def test_an_aoti_choice_for_another_torch_gives_way_to_onnxruntime(aoti_bundle, tmp_path):

    bundle = Path(shutil.copytree(aoti_bundle, tmp_path / "bundle"))

    def older_torch(manifest):
        for entry in manifest["aoti"]:
            entry["torch"] = "2.0.0"
        manifest["tuning"]["choices"][0].update(backend="aoti", options={"packages": "dynamic", "cuda_graph": False})

    edit_manifest(bundle, older_torch)
    runner = deploykit.load(bundle)
    assert runner.runner_for(1).backend == "onnxruntime"
    assert any(note.startswith("batch 1: the tuned aoti does not run here") and "2.0.0" in note
               for note in runner.notes)


@pytest.mark.slow
def test_bench_times_the_aoti_packages_by_kind(aoti_bundle, tmp_path):
    result = cli("bench", aoti_bundle, "--factory", "model_zoo:tiny_conv", "--device", "cpu", "--batch", "2,3",
                 "--only", "aoti-static,aoti-dynamic,deploykit-load", "--json", "-o", tmp_path, *FAST)
    assert result.returncode == 0, result.stderr
    entries = {e["key"]: e for e in json.loads(result.stdout)["contenders"]}
    assert all(entries[key]["status"] == "ok" for key in ("aoti-static", "aoti-dynamic", "deploykit-load")), entries
    assert [r["batch"] for r in entries["aoti-static"]["results"]] == [2]
    assert entries["aoti-static"]["not_timed"] == [3]
    assert [r["batch"] for r in entries["aoti-dynamic"]["results"]] == [2, 3]


def test_a_tuned_call_checks_its_feeds_once(tuned, monkeypatch):
    """The tuned runner reads the batch only; the runner it routes to checks the feeds, once per
    shape (``Runner.checked_feeds`` remembers the shapes that passed)."""
    from deploykit.backends.base import feeds as checking

    runner = deploykit.load(tuned, device="cpu")
    assert isinstance(runner, TunedRunner)
    collected, check = [], checking.check_feed
    monkeypatch.setattr(checking, "check_feed", lambda *args: collected.append(args) or check(*args))
    feeds = runtime.random_inputs(runner.inputs, 2)
    assert runner(feeds).keys() == set(runner.output_names) and len(collected) == 1
    [name] = runner.input_names
    assert runner(feeds[name]).keys() == set(runner.output_names) and len(collected) == 1
    assert runner(runtime.random_inputs(runner.inputs, 3)[name]).keys() == set(runner.output_names)
    assert len(collected) == 2
    with pytest.raises(BadInputError, match=f"missing {name}"):
        runner({})


def test_the_tuned_runner_knows_the_layouts_without_reading_the_graph(monkeypatch, tmp_path):
    """NHWC candidates exist only for a graph with convolutions; a tuned table's choices already say
    whether it has any, so ``load`` does not parse the graph to match them."""
    import onnxruntime

    from deploykit.bundle.read import Bundle
    from deploykit.tuning import candidates
    from deploykit.tuning.route import tuned_convolutions

    def unread(bundle):
        raise AssertionError("the graph was read")

    monkeypatch.setattr(candidates, "has_conv", unread)
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    bundle = Bundle(tmp_path, {})
    plain = [c.options for c in candidates.find_candidates(bundle, "cuda", convolutions=False)]
    assert plain == [{"cuda_graph": False}, {"cuda_graph": True}]
    layouts = [c.options for c in candidates.find_candidates(bundle, "cuda", convolutions=True)]
    assert {"cuda_graph": True, "prefer_nhwc": True} in layouts and len(layouts) == 4
    choice = {"batch": 1, "backend": "onnxruntime"}
    assert tuned_convolutions({"choices": [{**choice, "options": {"cuda_graph": True, "prefer_nhwc": False}}]})
    assert not tuned_convolutions({"choices": [{**choice, "options": {"cuda_graph": True}},
                                               {**choice, "backend": "aoti", "options": {"packages": "static"}}]})
