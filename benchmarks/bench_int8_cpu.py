"""int8 against fp32 on this CPU: ``deploykit convert --precision int8`` vs the fp32 bundle, in ONNX Runtime.

    python benchmarks/bench_int8_cpu.py [--model resnet18] [--work DIR] [--batches 1,8] [--rounds 7] [--openvino]
                                        [--auto-fix] [--out results/int8.json]

A torchvision classifier (``--model``, default resnet18) with random weights and BatchNorm statistics
measured on random images
(``calibrate_batch_norm``: random statistics make its logits near-constant), exported with a
dynamic batch, converted twice by the CLI: fp32, and int8 calibrated on ``--samples`` random images
given with ``--calibration``. A third graph, the int8 bundle's fp32 reference quantized with int8
*activations* (ONNX Runtime's S8S8) instead of deploykit's uint8 (U8S8), shows why uint8 was chosen.
The peer route, last: the same weights through plain ``torch.onnx.export`` and ONNX Runtime's
``quantize_static`` with its own choices (every op type it quantizes, U8S8), beside its fp32 graph.

Each graph runs in a plain ``onnxruntime.InferenceSession`` (CPU provider, default options), one
session at a time (see ``time_graphs``); at each batch size the graphs take turns in ``--rounds``
rounds of ``--calls`` calls, and a graph's time is the median over rounds of each round's median call. Accuracy: the int8 logits
against PyTorch fp32 on ``--check`` random images disjoint from the calibration samples (top-1
agreement, cosine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def torchvision_model(name: str):
    import torchvision

    return getattr(torchvision.models, name)()


def calibrated_model(name: str, image: int):
    """The torchvision model with random weights, BatchNorm statistics measured on random images."""
    import torch

    from deploykit.testing import calibrate_batch_norm

    torch.manual_seed(0)
    images = [torch.randn(8, 3, image, image, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    return calibrate_batch_norm(torchvision_model(name), images, seed=0)


def build_model(name: str, work: Path, image: int) -> Path:
    """``calibrated_model`` saved as a torch.export program (batch 1..16)."""
    import torch

    model = calibrated_model(name, image)
    program = torch.export.export(model, (torch.randn(2, 3, image, image),),
                                  dynamic_shapes={"x": {0: torch.export.Dim("batch", min=1, max=16)}})
    path = work / "model.pt2"
    torch.export.save(program, path)
    torch.save(model.state_dict(), work / "weights.pt")
    return path


def convert(model: Path, out: Path, *args: str) -> dict:
    """``deploykit convert`` in a subprocess, as users run it; its report."""
    command = [sys.executable, "-m", "deploykit", "convert", str(model), "-o", str(out), "--batch", "1:8:8",
               "--force", *args]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if not (out / "report.json").is_file():  # a failed validation (exit 1) still writes the bundle
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    report = json.loads((out / "report.json").read_text())
    report["convert_s"] = time.perf_counter() - started
    return report


def quantize(reference: Path, out: Path, samples: np.ndarray | dict[str, np.ndarray], activations: str,
             ops: list[str] | None) -> Path:
    """``reference`` quantized by plain ONNX Runtime (QDQ, per-channel int8 weights, minmax), with
    ``activations`` ("QInt8" or "QUInt8") and, where given, deploykit's op types only. ``samples``: the
    input x's rows, or rows of every input by name."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    named = samples if isinstance(samples, dict) else {"x": samples}
    count = len(next(iter(named.values())))

    class Reader:
        def __init__(self):
            self.rows = iter({name: rows[i:i + 1] for name, rows in named.items()} for i in range(count))

        def get_next(self):
            return next(self.rows, None)

    quantize_static(reference, out, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=getattr(QuantType, activations), weight_type=QuantType.QInt8,
                    calibrate_method=CalibrationMethod.MinMax, op_types_to_quantize=ops)
    return out


def plain_export(name: str, work: Path, image: int) -> Path:
    """The peer route a user writes without deploykit: torch.onnx.export of the same model (no
    deploykit passes; ONNX Runtime folds BatchNorm itself at load)."""
    import torch

    model = torchvision_model(name)
    model.load_state_dict(torch.load(work / "weights.pt"))
    path = work / "plain-fp32.onnx"
    torch.onnx.export(model.eval(), (torch.randn(1, 3, image, image),), path, input_names=["x"],
                      dynamic_axes={"x": {0: "batch"}}, dynamo=False)
    return path


def time_graphs(paths: dict[str, Path], feeds: dict[str, np.ndarray], rounds: int, calls: int) -> dict[str, float]:
    """Median ms per call of each graph on ``feeds``: in each round every graph gets a fresh session,
    three warm-up calls and ``calls`` timed ones; the graph's time is the median of its rounds' medians.
    An ``.onnx`` graph runs in ONNX Runtime, an ``.xml`` one (OpenVINO IR) in OpenVINO, a bundle folder as
    ``deploykit.load`` runs it on the CPU.

    One session exists at a time: ONNX Runtime's idle worker threads spin, and on this 2-core machine
    a second session's spinning takes the cores from the one being timed (measured: the int8 resnet18
    at batch 1 ran 4.6 ms alone, 7.4 ms with the fp32 session open beside it).
    """
    medians = {name: [] for name in paths}
    for _ in range(rounds):
        for name, path in paths.items():
            run = open_graph(path)
            for _ in range(3):
                run(feeds)
            times = []
            for _ in range(calls):
                started = time.perf_counter()
                run(feeds)
                times.append(time.perf_counter() - started)
            medians[name].append(statistics.median(times) * 1e3)
            del run
    return {name: statistics.median(values) for name, values in medians.items()}


def in_batches(feeds: dict[str, np.ndarray], size: int = 8) -> list[dict[str, np.ndarray]]:
    """``feeds`` (every input's rows by name) cut into consecutive batches of ``size`` rows."""
    count = len(next(iter(feeds.values())))
    return [{name: rows[start:start + size] for name, rows in feeds.items()} for start in range(0, count, size)]


def open_graph(path: Path):
    """A function from feeds to the list of outputs: ONNX Runtime's CPU provider for ``.onnx``, OpenVINO's
    CPU plugin for its ``.xml`` IR, with its float ops in fp32 (on a CPU with AMX or AVX-512 bf16 its default
    is bf16, which is not the fp32 being compared: its fp32 resnet50 drifted to cosine 0.995); a bundle folder
    through ``deploykit.load`` on the CPU (its OpenVINO model, where it has one), whatever its verdict (the
    accuracy check says how close it is)."""
    if path.is_dir():
        import deploykit

        runner = deploykit.load(path, device="cpu", allow_failed=True)
        return lambda feeds: list(runner.run(feeds).values())
    if path.suffix == ".xml":
        import openvino as ov

        request = ov.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}).create_infer_request()
        return lambda feeds: list(request.infer(feeds).values())
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda feeds: session.run(None, feeds)


def openvino_graphs(fp32: Path, samples: list[dict[str, np.ndarray]], work: Path) -> dict[str, Path]:
    """The CPU peer a user would pick (issue 26): OpenVINO on the same fp32 ONNX (converted to its IR, kept fp32),
    and NNCF's post-training int8 quantization of it calibrated on the same ``samples`` (one dict per batch)."""
    import nncf
    import openvino as ov

    model = ov.convert_model(str(fp32))
    ov.save_model(model, work / "openvino-fp32.xml", compress_to_fp16=False)
    quantized = nncf.quantize(model, nncf.Dataset(samples), subset_size=len(samples))  # every batch
    ov.save_model(quantized, work / "openvino-int8-nncf.xml", compress_to_fp16=False)
    return {"OpenVINO fp32 (same ONNX)": work / "openvino-fp32.xml",
            "OpenVINO int8 (NNCF)": work / "openvino-int8-nncf.xml"}


def accuracy(name: str, weights: Path, paths: dict[str, Path], image: int, count: int) -> dict[str, dict]:
    """Each graph's logits against PyTorch fp32 on ``count`` random images (seed 99: not calibration's)."""
    import torch

    model = torchvision_model(name)
    model.load_state_dict(torch.load(weights))
    images = np.random.default_rng(99).standard_normal((count, 3, image, image), dtype=np.float32)
    with torch.no_grad():
        reference = model.eval()(torch.from_numpy(images)).numpy().astype(np.float64)
    result = {}
    for name, path in paths.items():
        run = open_graph(path)
        logits = np.concatenate([run(batch)[0] for batch in in_batches({"x": images})])
        result[name] = agreement(logits, reference)
    return result


def agreement(logits: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """Top-1 agreement and cosine (over every logit of every image) of ``logits`` with ``reference``'s."""
    cosine = float((logits * reference).sum() / np.linalg.norm(logits) / np.linalg.norm(reference))
    return {"top1_agreement": float((logits.argmax(1) == reference.argmax(1)).mean()), "cosine": cosine}


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench_int8_cpu.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet18", help="a torchvision.models builder taking 3xNxN images")
    parser.add_argument("--work", type=Path, default=Path("/tmp/deploykit-bench-int8"))
    parser.add_argument("--image", type=int, default=224)
    add_shared_arguments(parser, samples=32, check=64, rounds=7, calls=10, unit="images")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    model = build_model(args.model, args.work, args.image)
    samples = np.random.default_rng(7).standard_normal((args.samples, 3, args.image, args.image), dtype=np.float32)
    np.savez(args.work / "calibration.npz", x=samples)
    fp32 = convert(model, args.work / "fp32")
    int8 = convert(model, args.work / "int8", *int8_flags(args, args.work / "calibration.npz"))
    from deploykit.conversion.quantize import QUANTIZED_OPS

    plain = plain_export(args.model, args.work, args.image)
    paths = {"fp32": args.work / "fp32" / "model.onnx", "int8 (U8S8, deploykit)": args.work / "int8" / "model.onnx",
             "int8 (S8S8)": quantize(args.work / "int8" / "model.fp32.onnx", args.work / "s8s8.onnx", samples,
                                     "QInt8", list(QUANTIZED_OPS)),
             "plain export fp32": plain,
             "plain export, quantize_static U8S8": quantize(plain, args.work / "plain-int8.onnx", samples, "QUInt8",
                                                            None)}
    if args.openvino:  # the int8 bundle's fp32 reference: standard ONNX ops only (no deploykit op)
        paths |= openvino_graphs(args.work / "int8" / "model.fp32.onnx", in_batches({"x": samples}), args.work)
        paths[BUNDLE_OPENVINO] = args.work / "int8"
    timings = {batch: time_graphs(paths, {"x": np.random.default_rng(batch).standard_normal(
                   (batch, 3, args.image, args.image), dtype=np.float32)}, args.rounds, args.calls)
               for batch in map(int, args.batches.split(","))}
    checked = accuracy(args.model, args.work / "weights.pt", paths, args.image, args.check)

    print_summary(f"{args.model} {args.image}x{args.image}", int8, timings)
    for name, metrics in checked.items():
        print(f"{name} vs PyTorch fp32 on {args.check} images: top-1 {metrics['top1_agreement']:.3f}, "
              f"cosine {metrics['cosine']:.5f}")
    write_results(args, timings, checked, fp32, int8)


#: The int8 bundle's OpenVINO model, as ``deploykit.load`` runs it (``--openvino``).
BUNDLE_OPENVINO = "int8 bundle, deploykit.load (OpenVINO, NNCF)"


def int8_flags(args, calibration: Path) -> list[str]:
    """``convert``'s int8 flags: the calibration, the method, ``--auto-fix`` and ``--backend openvino`` as asked."""
    return ["--precision", "int8", "--calibration", str(calibration), "--calibration-method", args.method,
            *(["--auto-fix"] if args.auto_fix else []), *(["--backend", "openvino"] if args.openvino else [])]


def add_shared_arguments(parser, samples: int, check: int, rounds: int, calls: int, unit: str) -> None:
    """The options every int8 benchmark takes: batches, calibration and check sizes, rounds, method, output."""
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--samples", type=int, default=samples, help=f"calibration {unit}")
    parser.add_argument("--check", type=int, default=check, help=f"{unit} for the accuracy check")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--calls", type=int, default=calls)
    parser.add_argument("--method", default="minmax", choices=["minmax", "entropy", "percentile"])
    parser.add_argument("--auto-fix", action="store_true", help="convert the int8 bundle with --auto-fix")
    parser.add_argument("--openvino", action="store_true",
                        help="convert the int8 bundle with --backend openvino too and time deploykit.load of it (its "
                             "OpenVINO model), beside OpenVINO on the fp32 ONNX and NNCF's int8 of it, as a user "
                             "would make them (pip install 'deploykit[openvino]')")
    parser.add_argument("--out", type=Path, help="write the results as JSON")


def print_summary(model: str, int8: dict, timings: dict[int, dict[str, float]]) -> None:
    """What was converted (the int8 verdict and node counts, auto-fix's outcome), then the markdown table of
    every graph's time at each batch and fp32's time over it."""
    import onnxruntime

    print(f"{model}, onnxruntime {onnxruntime.__version__}, {os.cpu_count()} CPUs; int8 convert verdict "
          f"{int8['verdict']} ({int8['convert_s']:.0f} s), {int8['precision']['nodes']['int8']} int8 / "
          f"{int8['precision']['nodes']['float']} float nodes")
    if fix := int8["precision"].get("auto_fix"):
        print(f"auto-fix: {fix['stopped']}; kept float: {', '.join(entry['node'] for entry in fix['kept_float'])}")
    print("| batch | graph | p50 ms | fp32 / graph |")
    print("| ---: | --- | ---: | ---: |")
    for batch, times in timings.items():
        for name, ms in times.items():
            print(f"| {batch} | {name} | {ms:.2f} | {times['fp32'] / ms:.2f} |")


def write_results(args, timings: dict, checked: dict, fp32: dict, int8: dict) -> None:
    """``--out``: the timings, accuracy, both verdicts, the int8 node counts and the arguments, as JSON."""
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"timings_ms": timings, "accuracy": checked, "verdicts": {
            "fp32": fp32["verdict"], "int8": int8["verdict"]}, "int8_nodes": int8["precision"]["nodes"],
            "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))


if __name__ == "__main__":
    main()
