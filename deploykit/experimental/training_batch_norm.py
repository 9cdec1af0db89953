"""BatchNorm as a PyTorch op on deploykit's CUDA kernels, with autograd.

Used to re-estimate BatchNorm statistics and fine-tune before export: ``batch_norm`` mirrors
``torch.nn.functional.batch_norm``, ``BatchNorm2d`` is a drop-in ``nn.BatchNorm2d`` and
``replace_batch_norm(model)`` swaps one for the other throughout a model.

* Training mode: per-channel batch statistics (Welford / Chan merges on the GPU, safe for data
  whose mean is large against its spread), running statistics updated in place with
  ``momentum`` and the unbiased variance, as PyTorch does; mean and inverse std are kept for
  the backward pass.
* Eval mode: the forward from running statistics runs ``dk_fused_batch_norm_cuda``, the
  FusedBatchNorm kernel of the exported model, with scale and bias folded from the running
  statistics (float64 runs an unfolded kernel instead).
* Backward: dx, dweight and dbias (training and eval mode); not differentiable twice.

Inputs: CUDA tensors of rank >= 2 (N, C, ...), float32, float16, bfloat16 or float64, any
shape and storage offset; non-contiguous inputs (channels_last too) are copied to contiguous
first. Statistics, weights and running statistics are float32 (float64 for float64 inputs);
weight and bias of other dtypes are cast, and their gradients cast back. Nothing in a call
synchronizes with the host, so steps can be captured in CUDA graphs (except ``BatchNorm2d``
with ``momentum=None``, whose cumulative average reads ``num_batches_tracked`` on the host, as
PyTorch's module does).

The kernel library is ``$DEPLOYKIT_KERNELS_LIB`` when set, else the one
``deploykit.native.build.build_plugins()`` builds (cached). C ABI: ``csrc/kernels/include/deploykit/
kernels.h``, section "BatchNorm for training".
"""

from __future__ import annotations

import ctypes
import math
import os
import threading

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from deploykit.native import kernels

__all__ = ["batch_norm", "BatchNorm2d", "replace_batch_norm", "library", "use_library"]

DTYPE_CODES = {torch.float32: kernels.FLOAT32, torch.float16: kernels.FLOAT16,
               torch.bfloat16: kernels.BFLOAT16, torch.float64: 3}
SYMBOLS = ("dk_batch_norm_workspace_bytes", "dk_batch_norm_train_forward_cuda",
           "dk_batch_norm_eval_forward_cuda", "dk_batch_norm_backward_cuda")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set argument and result types of the BatchNorm training entry points on ``lib``."""
    missing = [name for name in SYMBOLS if not hasattr(lib, name)]
    if missing:
        raise RuntimeError(f"the deploykit kernel library lacks {', '.join(missing)}: it was built "
                           "without CUDA (nvcc not found) or from older sources; rebuild it")
    vp, i64, size, dbl, c_int = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t,
                                 ctypes.c_double, ctypes.c_int)
    signatures = {
        "dk_batch_norm_workspace_bytes": (size, [c_int, i64, i64, i64]),
        "dk_batch_norm_train_forward_cuda": (
            c_int, [c_int, vp, vp, vp, vp, vp, dbl, dbl, vp, vp, vp, vp, size, i64, i64, i64, vp]),
        "dk_batch_norm_eval_forward_cuda": (
            c_int, [c_int, vp, vp, vp, vp, vp, dbl, vp, c_int, vp, size, i64, i64, i64, vp]),
        "dk_batch_norm_backward_cuda": (
            c_int, [c_int, vp, vp, vp, vp, vp, vp, vp, vp, vp, size, i64, i64, i64, c_int, vp]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


def library() -> ctypes.CDLL:
    """The kernel library: ``$DEPLOYKIT_KERNELS_LIB``, else deploykit's cached native build."""
    global _lib
    with _lock:
        if _lib is None:
            path = os.environ.get(kernels.ENV_VAR)
            if not path:
                from deploykit.native import build as native

                build = native.build_plugins()
                if build.kernels_library is None or not build.cuda:
                    why = build.disabled.get("cuda") or build.disabled.get("kernels")
                    raise RuntimeError("deploykit's CUDA kernels are not built"
                                       + (f": {why}" if why else "")
                                       + f"; set {kernels.ENV_VAR} to a CUDA build of "
                                       f"{kernels.LIBRARY_NAME}")
                path = str(build.kernels_library)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{kernels.ENV_VAR}={path}: no such file")
            _lib = declare(kernels.load(path))
        return _lib


def use_library(path: str | os.PathLike) -> ctypes.CDLL:
    """Use the kernel library at ``path`` from now on (tests, benchmarks)."""
    global _lib
    with _lock:
        _lib = declare(kernels.load(path))
        return _lib


# ------------------------------------------------------------------------------ raw calls


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(status: int, function: str, lib: ctypes.CDLL) -> None:
    kernels.check(status, function, lib)


def _geometry(x: torch.Tensor) -> tuple[int, int, int]:
    return x.shape[0], x.shape[1], math.prod(x.shape[2:])


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _workspace(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    n, c, hw = _geometry(x)
    nbytes = lib.dk_batch_norm_workspace_bytes(DTYPE_CODES[x.dtype], n, c, hw)
    if nbytes == 0 and c > 0:
        raise RuntimeError(f"dk_batch_norm_workspace_bytes failed for shape {tuple(x.shape)}")
    return torch.empty(max(nbytes, 16), dtype=torch.uint8, device=x.device)


def _per_channel(t: torch.Tensor | None, acc: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.detach().to(acc).contiguous()


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def train_forward(x: torch.Tensor, weight, bias, running_mean, running_var, momentum: float,
                  eps: float, *, y=None, save_mean=None,
                  save_invstd=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, save_mean, save_invstd) of a contiguous CUDA x; updates the running statistics.

    y, save_mean and save_invstd may be given (contiguous, right dtype): they are written.
    """
    lib = library()
    n, c, hw = _geometry(x)
    acc = _acc_dtype(x.dtype)
    if y is None:
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if save_mean is None:
        save_mean = torch.empty(c, dtype=acc, device=x.device)
    if save_invstd is None:
        save_invstd = torch.empty(c, dtype=acc, device=x.device)
    # Running statistics in another dtype or layout are updated through an acc-typed copy.
    stats = []
    for t in (running_mean, running_var):
        direct = t is None or (t.dtype == acc and t.is_contiguous())
        stats.append((t, t if direct else t.detach().to(acc).contiguous()))
    w, b = _per_channel(weight, acc), _per_channel(bias, acc)
    with torch.cuda.device(x.device):
        ws = _workspace(lib, x)
        status = lib.dk_batch_norm_train_forward_cuda(
            DTYPE_CODES[x.dtype], x.data_ptr(), _ptr(w), _ptr(b), _ptr(stats[0][1]),
            _ptr(stats[1][1]), float(momentum), float(eps), y.data_ptr(), save_mean.data_ptr(),
            save_invstd.data_ptr(), ws.data_ptr(), ws.numel(), n, c, hw, _stream(x.device))
    _check(status, "dk_batch_norm_train_forward_cuda", lib)
    for original, work in stats:
        if original is not None and work is not original:
            with torch.no_grad():
                original.copy_(work)
    return y, save_mean, save_invstd


def eval_forward(x: torch.Tensor, weight, bias, running_mean, running_var, eps: float, *,
                 y=None, fold: bool = True) -> torch.Tensor:
    """y of a contiguous CUDA x from running statistics (written into ``y`` if given).

    fold=True runs the deployed FusedBatchNorm kernel on folded scale / bias (float64: always
    unfolded); fold=False the unfolded (x - mean) * scale + bias.
    """
    lib = library()
    n, c, hw = _geometry(x)
    acc = _acc_dtype(x.dtype)
    if y is None:
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
    w, b = _per_channel(weight, acc), _per_channel(bias, acc)
    rm, rv = _per_channel(running_mean, acc), _per_channel(running_var, acc)
    with torch.cuda.device(x.device):
        ws = _workspace(lib, x)
        status = lib.dk_batch_norm_eval_forward_cuda(
            DTYPE_CODES[x.dtype], x.data_ptr(), _ptr(w), _ptr(b), _ptr(rm), _ptr(rv), float(eps),
            y.data_ptr(), int(bool(fold)), ws.data_ptr(), ws.numel(), n, c, hw, _stream(x.device))
    _check(status, "dk_batch_norm_eval_forward_cuda", lib)
    return y


def backward(dy: torch.Tensor, x: torch.Tensor, weight, mean: torch.Tensor,
             invstd: torch.Tensor, training: bool, need_dx: bool = True,
             need_dweight: bool = True, need_dbias: bool = True, *, dx=None, dweight=None,
             dbias=None):
    """(dx, dweight, dbias) in x's dtype and the statistics' dtype; None where not asked for.

    dx, dweight and dbias may be given (contiguous, right dtype): they are written.
    """
    lib = library()
    n, c, hw = _geometry(x)
    acc = _acc_dtype(x.dtype)
    dy = dy.to(x.dtype).contiguous()
    if need_dx and dx is None:
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    if need_dweight and dweight is None:
        dweight = torch.empty(c, dtype=acc, device=x.device)
    if need_dbias and dbias is None:
        dbias = torch.empty(c, dtype=acc, device=x.device)
    if not need_dx:
        dx = None
    if not need_dweight:
        dweight = None
    if not need_dbias:
        dbias = None
    w = _per_channel(weight, acc)
    with torch.cuda.device(x.device):
        ws = _workspace(lib, x)
        status = lib.dk_batch_norm_backward_cuda(
            DTYPE_CODES[x.dtype], dy.data_ptr(), x.data_ptr(), _ptr(w), mean.data_ptr(),
            invstd.data_ptr(), _ptr(dx), _ptr(dweight), _ptr(dbias), ws.data_ptr(), ws.numel(),
            n, c, hw, int(bool(training)), _stream(x.device))
    _check(status, "dk_batch_norm_backward_cuda", lib)
    return dx, dweight, dbias


# ------------------------------------------------------------------------------ autograd


class BatchNormFunction(torch.autograd.Function):
    """y = batch_norm(x); running statistics are updated in forward (training mode)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps):
        x = x.contiguous()
        acc = _acc_dtype(x.dtype)
        if training:
            y, mean, invstd = train_forward(x, weight, bias, running_mean, running_var,
                                            momentum, eps)
        else:
            y = eval_forward(x, weight, bias, running_mean, running_var, eps)
            # Copies: later training steps update the running statistics in place.
            mean = running_mean.detach().to(acc, copy=True)
            invstd = torch.rsqrt(running_var.detach().to(acc) + eps)
        ctx.training = bool(training)
        ctx.param_dtypes = (None if weight is None else weight.dtype,
                            None if bias is None else bias.dtype)
        ctx.save_for_backward(x, weight, mean, invstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_w = need_w and weight is not None
        need_b = need_b and ctx.param_dtypes[1] is not None
        if not (need_x or need_w or need_b):
            return (None,) * 8
        dx, dw, db = backward(dy, x, weight, mean, invstd, ctx.training, need_x, need_w, need_b)
        if dw is not None:
            dw = dw.to(ctx.param_dtypes[0])
        if db is not None:
            db = db.to(ctx.param_dtypes[1])
        return dx, dw, db, None, None, None, None, None


def _check_args(input, running_mean, running_var, weight, bias, training, momentum, eps) -> None:
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    if input.dtype not in DTYPE_CODES:
        raise TypeError(f"input has dtype {input.dtype}; deploykit's batch_norm supports "
                        "float32, float16, bfloat16 and float64")
    if input.dim() < 2:
        raise ValueError(f"input must have shape (N, C, ...), got {tuple(input.shape)}")
    channels = input.shape[1]
    for name, t in (("running_mean", running_mean), ("running_var", running_var),
                    ("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if tuple(t.shape) != (channels,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({channels},) for "
                             f"input of shape {tuple(input.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} has dtype {t.dtype}, expected a floating-point dtype")
    if (running_mean is None) != (running_var is None):
        raise ValueError("pass both running_mean and running_var, or neither")
    if not training and running_mean is None:
        raise ValueError("running_mean and running_var are needed when training=False")
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    if not isinstance(momentum, (int, float)) or math.isnan(momentum):
        raise ValueError(f"momentum must be a number, got {momentum!r}")
    if training and input.numel() // max(channels, 1) <= 1 and input.numel() > 0:
        raise ValueError("Expected more than 1 value per channel when training, got input "
                         f"size {tuple(input.shape)}")
    if input.device.type != "cuda":
        raise RuntimeError(f"deploykit.experimental.training_batch_norm runs on CUDA tensors only; input is on "
                           f"{input.device} (use torch.nn.functional.batch_norm there)")
    if not torch.cuda.is_available():  # pragma: no cover - a CUDA tensor implies CUDA
        raise RuntimeError("CUDA is not available")
    for name, t in (("running_mean", running_mean), ("running_var", running_var),
                    ("weight", weight), ("bias", bias)):
        if t is not None and t.device != input.device:
            raise ValueError(f"{name} is on {t.device}, input on {input.device}")


def batch_norm(input: torch.Tensor, running_mean: torch.Tensor | None,
               running_var: torch.Tensor | None, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, training: bool = False, momentum: float = 0.1,
               eps: float = 1e-5) -> torch.Tensor:
    """``torch.nn.functional.batch_norm`` on deploykit's CUDA kernels (same arguments).

    Raises RuntimeError for tensors not on a CUDA device.
    """
    _check_args(input, running_mean, running_var, weight, bias, training, momentum, eps)
    if input.numel() == 0:  # nothing to normalize; running statistics are left alone
        return input.clone()
    return BatchNormFunction.apply(input, weight, bias, running_mean, running_var,
                                   bool(training), float(momentum), float(eps))


# ------------------------------------------------------------------------------ module


class BatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` running deploykit's CUDA kernels for CUDA inputs (PyTorch's own
    implementation for inputs on other devices). Same parameters, buffers and state dict."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.device.type != "cuda" or input.dtype not in DTYPE_CODES:
            return super().forward(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average (reads the count on the host)
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        keep = not self.training or self.track_running_stats
        return batch_norm(input, self.running_mean if keep else None,
                          self.running_var if keep else None, self.weight, self.bias,
                          use_batch_stats, factor, self.eps)


def replace_batch_norm(model: nn.Module) -> nn.Module:
    """Replace every ``nn.BatchNorm2d`` in ``model`` (in place; returned too) by ``BatchNorm2d``.

    The new modules hold the same Parameter and buffer objects (optimizers and state dicts keep
    working) and the same training flag. Subclasses of nn.BatchNorm2d other than ours are left
    alone. A bare ``nn.BatchNorm2d`` passed as ``model`` is returned replaced.
    """
    if type(model) is nn.BatchNorm2d:
        return _converted(model)
    for name, child in list(model.named_children()):
        if type(child) is nn.BatchNorm2d:
            setattr(model, name, _converted(child))
        else:
            replace_batch_norm(child)
    return model


def _converted(old: nn.BatchNorm2d) -> BatchNorm2d:
    new = BatchNorm2d(old.num_features, eps=old.eps, momentum=old.momentum, affine=old.affine,
                      track_running_stats=old.track_running_stats, device="meta")
    for name in ("weight", "bias"):
        setattr(new, name, getattr(old, name))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        new._buffers[name] = old._buffers.get(name)
    new.train(old.training)
    return new


