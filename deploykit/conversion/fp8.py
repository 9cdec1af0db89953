"""Convert's fp8 stage: ``convert --precision fp8 --backend aoti``.

The matrix products of the model's ``nn.Linear`` layers run in float8 e4m3 through
``torch._scaled_mm`` (cuBLASLt's fp8 kernels on compute capability >= 8.9), compiled into the
AOTInductor packages; everything else computes in fp16, and the bundle's ONNX graph is the fp16
graph (ONNX Runtime has no fast fp8 kernels). Scales are per tensor and static: each weight's
from its largest magnitude, each activation's from the largest magnitude the layer's input reached
on the calibration samples, so quantizing an activation is one multiply and cast that inductor
fuses into the op that produced it. docs/precision.md says why and what was measured.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn.functional as F

from deploykit.backends.torch.runner import flatten_outputs
from deploykit.bundle.format import REFERENCE_MODEL
from deploykit.conversion.quantize import Calibration, random_data_note
from deploykit.conversion.quantize_fix import QuantizationFix, Ranked
from deploykit.errors import BadInputError, EnvironmentProblem

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
#: compute capability of the first GPUs with fp8 tensor cores (Ada, Hopper)
MIN_CUDA_CAPABILITY = (8, 9)
#: cuBLASLt's fp8 products take inner and output sizes that are multiples of 16
ALIGNMENT = 16
FORMAT = ("torch._scaled_mm in the AOTInductor packages: float8 e4m3 weights and activations of the nn.Linear "
          "layers, static per-tensor scales; the rest fp16; model.onnx is the fp16 graph")
RANDOM_DATA_NOTE = random_data_note("fp8")
_IN_ATTENTION = ("inside an nn.MultiheadAttention deploykit cannot restructure (separate key/value sizes, bias_kv "
                 "or zero_attn), which reads the layer's weight directly")
AUTO_FIX_REASON = "kept in fp16 by --auto-fix: alone in fp8 it made the outputs diverge the most"
AUTO_FIX_METHOD = ("rank the fp8 Linear layers by the relative error of the outputs with each alone in fp8 (the rest "
                   "fp32, on the CPU); keep the worst 1, 2, 4 ... in fp16 and compile again until the outputs pass")
NOT_CALLED = ("not called on the calibration samples, or in an attention called with masks or need_weights=True "
               "(computed as nn.MultiheadAttention computes it)")


def check_options(options) -> None:
    """fp8 is compiled into AOTInductor packages with activation ranges taken as measured (minmax), or
    written as Q/DQ into the graph TensorRT builds from (``quantize``: ONNX Runtime's fp8 calibration)."""
    if options.precision != "fp8":
        return
    if options.backend not in ("aoti", "tensorrt"):
        raise BadInputError(f"--backend {options.backend} is not supported with --precision fp8 (fp8 is compiled "
                            "into AOTInductor packages, or written for TensorRT); add --backend aoti or --backend "
                            "tensorrt, or convert with --precision fp16")
    if options.io_precision is not None:
        raise BadInputError("--io-precision is not supported with --precision fp8 (inputs and outputs keep their "
                            "declared types); drop --io-precision")
    if options.calibration_method != "minmax":
        raise BadInputError(f"--calibration-method {options.calibration_method} applies to int8; fp8 scales are "
                            "the calibrated largest magnitudes for AOTInductor, ONNX Runtime's distribution "
                            "calibration for TensorRT: drop --calibration-method")


def check_source(kind: str) -> None:
    """fp8 replaces nn.Linear modules, which a torch.export program no longer has (its graph calls aten.linear)."""
    if kind == "exported_program":
        raise BadInputError("--precision fp8 needs the model as an nn.Module: a torch.export program has no "
                            "nn.Linear layers left to replace; pass its state_dict with --factory, or convert with "
                            "--precision fp16")


def check_device(device: str) -> None:
    """fp8 tensor cores start at compute capability 8.9; on the CPU torch's fp8 kernels compute it exactly."""
    if device != "cuda":
        return
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CUDA_CAPABILITY:
        raise EnvironmentProblem(f"--precision fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper, "
                                 f"Blackwell); {torch.cuda.get_device_name()} is {capability[0]}.{capability[1]}: "
                                 "convert with --precision fp16")


class Fp8Linear(torch.nn.Module):
    """``nn.Linear`` with its product in fp8: y = (x / s_x) @ (W / s_w)^T * s_x * s_w + b, the two
    quotients cast to e4m3 (clamped to its range), returned in x's dtype. The sums use the tensor
    cores' fast accumulation (``use_fast_accum``: no periodic promotion to fp32, as torchao's
    inference configs and TensorRT do): faster on Hopper, and validation checks what it costs."""

    def __init__(self, linear: torch.nn.Linear, input_amax: float):
        super().__init__()
        weight = linear.weight.detach().float()
        weight_scale = (weight.abs().max() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        input_scale = max(input_amax, torch.finfo(torch.float32).tiny) / FP8_MAX
        self.register_buffer("weight", (weight / weight_scale).to(FP8))  # [out, in]: its .t() is column-major
        self.register_buffer("weight_scale", weight_scale.reshape(()))
        self.register_buffer("input_scale", torch.tensor(input_scale, dtype=torch.float32))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        quantized = (rows * (1.0 / self.input_scale).to(x.dtype)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        product = torch._scaled_mm(quantized, self.weight.t(), scale_a=self.input_scale, scale_b=self.weight_scale,
                                   bias=bias, out_dtype=x.dtype, use_fast_accum=True)
        return product.reshape(*x.shape[:-1], product.shape[-1])


class SelfAttention(torch.nn.Module):
    """nn.MultiheadAttention's self-attention with its two products as ``nn.Linear`` layers (``in_proj``
    for query, key and value at once, ``out_proj``), so that fp8 can replace them: the module reads its
    weights inside ``F.multi_head_attention_forward``. Calls with masks, distinct key or value, or
    ``need_weights=True`` are computed as nn.MultiheadAttention computes them (and stay float)."""

    def __init__(self, attention: torch.nn.MultiheadAttention):
        super().__init__()
        width = attention.embed_dim
        self.width, self.heads, self.batch_first = width, attention.num_heads, attention.batch_first
        self.in_proj = torch.nn.Linear(width, 3 * width, bias=attention.in_proj_bias is not None)
        self.out_proj = torch.nn.Linear(width, width, bias=attention.out_proj.bias is not None)
        with torch.no_grad():
            self.in_proj.weight.copy_(attention.in_proj_weight)
            self.out_proj.weight.copy_(attention.out_proj.weight)
            if attention.in_proj_bias is not None:
                self.in_proj.bias.copy_(attention.in_proj_bias)
            if attention.out_proj.bias is not None:
                self.out_proj.bias.copy_(attention.out_proj.bias)
        self.to(device=attention.in_proj_weight.device, dtype=attention.in_proj_weight.dtype)

    @staticmethod
    def replaces(attention: torch.nn.Module) -> bool:
        return (isinstance(attention, torch.nn.MultiheadAttention) and attention._qkv_same_embed_dim
                and attention.bias_k is None and not attention.add_zero_attn)

    @staticmethod
    def restructured(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                     average_attn_weights=True, is_causal=False) -> bool:
        """Whether a call computes through the two Linear layers (else as nn.MultiheadAttention does)."""
        return (query is key is value and key_padding_mask is None and attn_mask is None and not need_weights
                and not is_causal)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if not self.restructured(query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                                 is_causal):
            inputs = [t.transpose(0, 1) for t in (query, key, value)] if self.batch_first else (query, key, value)
            out, weights = F.multi_head_attention_forward(
                *inputs, self.width, self.heads, self.in_proj.weight, self.in_proj.bias, None, None, False, 0.0,
                self.out_proj.weight, self.out_proj.bias, training=False, key_padding_mask=key_padding_mask,
                need_weights=need_weights, attn_mask=attn_mask, average_attn_weights=average_attn_weights,
                is_causal=is_causal)
            return (out.transpose(0, 1) if self.batch_first else out), weights
        x = query if self.batch_first else query.transpose(0, 1)
        batch, tokens, width = x.shape
        q, k, v = self.in_proj(x).view(batch, tokens, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        mixed = F.scaled_dot_product_attention(q, k, v)
        out = self.out_proj(mixed.transpose(1, 2).reshape(batch, tokens, width))
        return (out if self.batch_first else out.transpose(0, 1)), None


def with_linear_attention(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with each self-attention it can restructure a :class:`SelfAttention` (same results)."""
    for name, sub in list(module.named_modules()):
        if SelfAttention.replaces(sub):
            module.set_submodule(name, SelfAttention(sub))
    return module


@dataclasses.dataclass
class Fp8Stage:
    """What was quantized (the Linear layers by qualified name, with their inputs' calibrated ranges),
    what stayed fp16 and why, and what calibrated it."""

    calibration: Calibration
    input_amax: dict[str, float]  # the quantized layers
    float_layers: dict[str, str]  # layer -> why it stays fp16
    fix: QuantizationFix | None = None  # --auto-fix: the ranking and each round

    @classmethod
    def start(cls, module: torch.nn.Module, calibration: Calibration) -> Fp8Stage:
        module = with_linear_attention(copy.deepcopy(module).float().cpu().eval())
        eligible, float_layers = _eligible_linears(module)
        if not eligible:
            reasons = "; ".join(f"{name}: {why}" for name, why in list(float_layers.items())[:3])
            raise BadInputError("--precision fp8 found no nn.Linear layer to quantize"
                                f"{' (' + reasons + ')' if reasons else ''}; convert with --precision fp16")
        amax = _calibrate(module, eligible, calibration)
        float_layers.update({name: NOT_CALLED for name, value in amax.items() if value is None})
        return cls(calibration, {name: value for name, value in amax.items() if value is not None}, float_layers)

    def apply(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` (a copy, in its compute precision) with its self-attention restructured and each
        quantized layer an :class:`Fp8Linear`."""
        module = with_linear_attention(module)
        for name, amax in self.input_amax.items():
            linear = module.get_submodule(name)
            module.set_submodule(name, Fp8Linear(linear, amax).to(linear.weight.device))
        return module

    def keeping_float(self, layers: list[str]) -> Fp8Stage:
        """This stage with ``layers`` kept in fp16 by auto-fix."""
        kept = set(layers)
        return dataclasses.replace(
            self, input_amax={name: amax for name, amax in self.input_amax.items() if name not in kept},
            float_layers={**self.float_layers, **dict.fromkeys(layers, AUTO_FIX_REASON)})

    @torch.no_grad()
    def rank_layers(self, module: torch.nn.Module, feeds: dict) -> list[Ranked]:
        """The fp8 layers, worst first by the relative error of the outputs (on ``feeds``, against fp32, on
        the CPU) when that layer alone computes in fp8."""
        model = with_linear_attention(copy.deepcopy(module).float().cpu().eval())
        args = [torch.from_numpy(array) for array in feeds.values()]
        exact = _flat(model(*args))
        ranked = []
        for name, amax in self.input_amax.items():
            linear = model.get_submodule(name)
            model.set_submodule(name, Fp8Linear(linear, amax))
            error = float(torch.linalg.vector_norm(_flat(model(*args)) - exact) / torch.linalg.vector_norm(exact))
            model.set_submodule(name, linear)
            ranked.append(Ranked(name, "Linear", error))
        return sorted(ranked, key=lambda r: r.added_error, reverse=True)

    def inconclusive_reasons(self, output_names: list[str]) -> dict[str, str]:
        """Every output, where the scales were fitted to random data: passing proves nothing for real inputs."""
        return dict.fromkeys(output_names, RANDOM_DATA_NOTE) if self.calibration.random else {}

    def to_json(self) -> dict:
        return {
            "precision": "fp8",
            "io_precision": None,
            "reference_model": REFERENCE_MODEL,
            "format": FORMAT,
            "calibration_method": "minmax",
            "calibration": self.calibration.to_json("fp8"),
            "nodes": {"fp8": len(self.input_amax), "float": len(self.float_layers)},
            "quantized_nodes": list(self.input_amax),
            "float_nodes": [{"node": name, "op": "Linear", "precision": "fp16", "reason": why}
                            for name, why in self.float_layers.items()],
            "auto_fix": self.fix.to_json() if self.fix else None,
        }


def _eligible_linears(module: torch.nn.Module) -> tuple[list[str], dict[str, str]]:
    """The Linear layers fp8 can take, and why each other one cannot."""
    in_attention = {f"{name}.{child}" if name else child
                    for name, sub in module.named_modules() if isinstance(sub, torch.nn.MultiheadAttention)
                    for child, _ in sub.named_children()}
    eligible, float_layers = [], {}
    for name, sub in module.named_modules():
        if not isinstance(sub, torch.nn.Linear):
            continue
        if name in in_attention:  # nn.MultiheadAttention's out_proj: the module reads its weight
            float_layers[name] = _IN_ATTENTION
        elif sub.in_features % ALIGNMENT or sub.out_features % ALIGNMENT:
            float_layers[name] = (f"{sub.in_features} inputs, {sub.out_features} outputs: fp8 products need "
                                  f"multiples of {ALIGNMENT}")
        else:
            eligible.append(name)
    return eligible, float_layers


def _flat(outputs) -> torch.Tensor:
    return torch.cat([t.double().flatten() for t in flatten_outputs(outputs) if t.is_floating_point()])


@torch.no_grad()
def _calibrate(model: torch.nn.Module, layers: list[str], calibration: Calibration) -> dict[str, float | None]:
    """The largest magnitude each layer's input reaches over the calibration batches (None: never called)."""
    amax = dict.fromkeys(layers)

    def record(name):
        def hook(_layer, args):
            amax[name] = max(amax[name] or 0.0, float(args[0].detach().abs().max()))
        return hook

    unrestructured = set()  # attentions called as nn.MultiheadAttention: their layers' weights must stay float

    def check(name):
        def hook(_attention, args, kwargs):
            if not SelfAttention.restructured(*args, **kwargs):
                unrestructured.update({f"{name}.in_proj", f"{name}.out_proj"})
        return hook

    handles = [model.get_submodule(name).register_forward_pre_hook(record(name)) for name in layers]
    handles += [sub.register_forward_pre_hook(check(name), with_kwargs=True)
                for name, sub in model.named_modules() if isinstance(sub, SelfAttention)]
    try:
        for batch in calibration.batches:
            model(*(torch.from_numpy(array) for array in batch.values()))
    finally:
        for handle in handles:
            handle.remove()
    return {name: None if name in unrestructured else value for name, value in amax.items()}
