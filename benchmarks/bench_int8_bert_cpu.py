"""BERT-base int8 against fp32 on this CPU: ``deploykit convert --precision int8`` vs the fp32 bundle, in ONNX Runtime.

    python benchmarks/bench_int8_bert_cpu.py [--work DIR] [--batches 1,8] [--seq 128] [--rounds 5]
                                             [--auto-fix] [--openvino] [--out results/bert-int8.json]

model_zoo's ``bert_base`` (transformers' BertModel at BERT-base's size, random weights, a 1,000-token
vocabulary) taking ``input_ids`` and ``attention_mask`` and returning the last hidden states, converted
twice by the CLI with a dynamic batch: fp32, and int8 calibrated with ``--calibration`` on ``--samples``
random sequences (ids inside the vocabulary, every position unmasked). The peer route, last: ONNX
Runtime's ``quantize_dynamic`` (int8 weights, activations quantized per call) of the fp32 bundle's graph,
what a user quantizing a transformer for ONNX Runtime on a CPU reaches for first.

``--fusions``: two more graphs from the int8 bundle's fp32 reference, fused before int8 (``fused_int8_graphs``):
whether fewer float ops between Q/DQ pairs (fused SkipLayerNormalization, BiasGelu, a fused attention core)
buy the speed the int8 bundle lacks. Same calibration sequences.

Timing as bench_int8_cpu.py's ``time_graphs`` (one session at a time, graphs taking turns in rounds,
median of the rounds' medians). Accuracy: each graph's hidden states against PyTorch fp32 on ``--check``
sequences disjoint from the calibration ones (cosine over everything, and the lowest per-sequence cosine).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests" / "helpers")]

from bench_int8_cpu import (BUNDLE_OPENVINO, add_shared_arguments, convert, in_batches, int8_flags,  # noqa: E402
                            open_graph, openvino_graphs, print_summary, quantize, time_graphs, write_results)

VOCABULARY = 1000  # model_zoo.BertEncoder's


def sequences(count: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    """``count`` random sequences: ids inside the vocabulary, a [CLS]/[SEP]-like frame, a full mask."""
    ids = np.random.default_rng(seed).integers(150, VOCABULARY, (count, seq), dtype=np.int64)
    ids[:, 0], ids[:, -1] = 101, 102
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def reference_states(weights: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import torch

    import model_zoo

    model = model_zoo.bert_base()
    model.load_state_dict(torch.load(weights))
    with torch.no_grad():
        return model.eval()(**{name: torch.from_numpy(array) for name, array in feeds.items()}).numpy()


def accuracy(paths: dict[str, Path], feeds: dict[str, np.ndarray], reference: np.ndarray) -> dict[str, dict]:
    result = {}
    for name, path in paths.items():
        run = open_graph(path)
        states = np.concatenate([run(batch)[0] for batch in in_batches(feeds)]).astype(np.float64)
        want = reference.astype(np.float64)
        per_sequence = [float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b)) for a, b in zip(states, want)]
        result[name] = {"cosine": float((states * want).sum() / np.linalg.norm(states) / np.linalg.norm(want)),
                        "lowest_sequence_cosine": min(per_sequence)}
    return result


def fused_int8_graphs(reference: Path, samples: dict[str, np.ndarray], work: Path) -> dict[str, Path]:
    """``reference`` fused two ways before int8: ONNX Runtime's transformer optimizer then its ``quantize_static``
    (a user's route), and onnxscript's fusions that deploykit's ort_fusions pass runs, minus the last step that
    packs the Q/K/V projections into one Attention op (which would hide them from quantization: here they stay
    MatMuls around a float MultiHeadAttention), then deploykit's own ``quantize``."""
    import onnx
    import onnx_ir as ir
    from onnxruntime.transformers.optimizer import optimize_model
    from onnxscript.rewriter.ort_fusions import _core as fusions

    from deploykit.conversion.quantize import quantize as deploykit_quantize

    optimized = optimize_model(str(reference), model_type="bert", num_heads=12, hidden_size=768, opt_level=0)
    print(f"ONNX Runtime's optimizer: {sorted(optimized.get_fused_operator_statistics().items())}")
    optimized.save_model_to_file(str(work / "fused-ort.onnx"))
    graphs = {"int8 after ORT optimizer fusions": quantize(work / "fused-ort.onnx", work / "fused-ort-int8.onnx",
                                                           samples, "QUInt8", None)}
    model = fusions._pre_optimize(ir.load(str(reference)))
    counts = {"sdpa": fusions.fuse_sdpa(model, apply_shape_inference=True)}
    for name in ("erfgelu", "skip_layer_normalization", "mha1", "mha2", "mha_scale", "mha_bias", "gelu", "bias_gelu"):
        counts[name] = getattr(fusions, f"fuse_{name}")(model)
    fusions.optimize(model)
    print(f"onnxscript's fusions without Attention: {counts}")
    onnx.save(deploykit_quantize(ir.serde.serialize_model(model), in_batches(samples), "minmax"),
              work / "fused-mha-int8.onnx")
    return graphs | {"int8 after MultiHeadAttention fusions (deploykit quantize)": work / "fused-mha-int8.onnx"}


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench_int8_bert_cpu.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/deploykit-bench-int8-bert"))
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--fusions", action="store_true", help="add ONNX Runtime's transformer fusions, then int8")
    add_shared_arguments(parser, samples=64, check=16, rounds=5, calls=5, unit="sequences")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "helpers"), os.environ.get("PYTHONPATH", "")])

    import torch

    import model_zoo

    torch.manual_seed(0)
    weights = args.work / "bert_base.pt"
    torch.save(model_zoo.bert_base().state_dict(), weights)
    calibration = sequences(args.samples, args.seq, seed=7)
    np.savez(args.work / "calibration.npz", **calibration)
    inputs = ["--factory", "model_zoo:bert_base", "--input", f"input_ids:1x{args.seq}:int64",
              "--input", f"attention_mask:1x{args.seq}:int64"]
    fp32 = convert(weights, args.work / "fp32", *inputs)
    int8 = convert(weights, args.work / "int8", *inputs, *int8_flags(args, args.work / "calibration.npz"))
    from onnxruntime.quantization import QuantType, quantize_dynamic

    dynamic = args.work / "dynamic-int8.onnx"
    quantize_dynamic(args.work / "fp32" / "model.onnx", dynamic, weight_type=QuantType.QInt8)
    paths = {"fp32": args.work / "fp32" / "model.onnx", "int8 (deploykit)": args.work / "int8" / "model.onnx",
             "fp32 bundle, quantize_dynamic": dynamic}
    if args.openvino:  # the int8 bundle's fp32 reference: standard ONNX ops only (no ONNX Runtime fusions)
        paths |= openvino_graphs(args.work / "int8" / "model.fp32.onnx", in_batches(calibration), args.work)
        paths[BUNDLE_OPENVINO] = args.work / "int8"
    if args.fusions:
        paths |= fused_int8_graphs(args.work / "int8" / "model.fp32.onnx", calibration, args.work)
    timings = {batch: time_graphs(paths, sequences(batch, args.seq, seed=batch), args.rounds, args.calls)
               for batch in map(int, args.batches.split(","))}
    check = sequences(args.check, args.seq, seed=99)
    checked = accuracy(paths, check, reference_states(weights, check))

    print_summary(f"bert_base seq {args.seq} (fp32 verdict {fp32['verdict']})", int8, timings)
    for name, metrics in checked.items():
        print(f"{name} vs PyTorch fp32 on {args.check} sequences: cosine {metrics['cosine']:.5f}, lowest per "
              f"sequence {metrics['lowest_sequence_cosine']:.5f}")
    write_results(args, timings, checked, fp32, int8)


if __name__ == "__main__":
    main()
