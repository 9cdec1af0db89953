"""deploykit.experimental.training_batch_norm on the GPU against torch.nn.functional.batch_norm and float64 truth.

Checks: gradcheck in float64 (the float64 CUDA kernels, training and eval mode); outputs,
gradients and running statistics on fresh random data for float32 / float16 / bfloat16 and odd
shapes; data with mean 1e4 and std 1e-2; storage offsets that break 16-byte alignment; every
output poisoned with NaN (between NaN guard elements that must survive) before the call; CUDA
graph capture; the BatchNorm2d module and replace_batch_norm.

The kernel library is $DEPLOYKIT_KERNELS_LIB if set, else built once for this GPU.
"""

from __future__ import annotations

import copy
import os
import shutil
import zlib

import pytest

torch = pytest.importorskip("torch")

from deploykit.native import kernels  # noqa: E402
from deploykit.experimental import training_batch_norm as bn  # noqa: E402

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

F = torch.nn.functional
LOW = (torch.float16, torch.bfloat16)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (N, C, spatial...): short rows, long unaligned rows (segments) and long aligned rows (plane
# vectors, several chunks per channel), sizes not divisible by 4 or 8. Channel tiles (rows of at
# most 1 KB, C a multiple of the vector width): C a multiple of the tile and not
# (partial last group), rows of 1, 25, 49 and 64 values, and rows that 2 or 4 threads share
# (196, 169 (uneven parts) and 256 values; 441 fp16 values: 4 threads, pairs, a partial batch).
SHAPES = [(2, 3, 5, 7), (4, 16, 33, 31), (3, 5, 1, 1), (1, 3, 1027, 1), (16, 8, 7, 7),
          (5, 3, 1025), (7, 13), (2, 4, 64, 48), (9, 2, 3, 2, 5), (9, 2, 1032),
          (3, 2, 48, 128), (70, 3, 9, 9), (6, 72, 7, 7), (3, 136, 8, 8), (5, 200, 5, 5), (33, 128, 7, 7),
          (4, 64, 1, 1), (9, 72, 14, 14), (5, 80, 13, 13), (3, 16, 16, 16), (2, 16, 21, 21)]


@pytest.fixture(scope="module", autouse=True)
def lib(tmp_path_factory):
    path = os.environ.get(kernels.ENV_VAR)
    if not path:
        if shutil.which("cmake") is None:
            pytest.skip("cmake not found: cannot build the kernel library")
        major, minor = torch.cuda.get_device_capability()
        path = kernels.build_library(tmp_path_factory.mktemp("bn-build"),
                                     cuda_architectures=f"{major}{minor}")
    return bn.use_library(path)


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def randn(shape, g, dtype=torch.float32, mean=0.0, std=1.0) -> torch.Tensor:
    """Random CUDA tensor of `dtype` (drawn in float64 on the CPU, rounded once)."""
    return (torch.randn(shape, generator=g, dtype=torch.float64) * std + mean).to(dtype).cuda()


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Normwise relative error; NaN anywhere fails."""
    a, ref = a.double(), ref.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - ref).norm() / ref.norm().clamp_min(1e-300))


def params(c, g, dtype=torch.float32):
    w = randn((c,), g, dtype, mean=1.0, std=0.5)
    b = randn((c,), g, dtype, std=0.5)
    rm = randn((c,), g, torch.float32, std=0.3)
    rv = (randn((c,), g, torch.float32, std=0.3).abs() + 0.5)
    return w, b, rm, rv


def run_both(x, w, b, rm, rv, training, momentum=0.1, eps=1e-5, dy=None):
    """(ours, torch in x's dtype, torch in float64): each (y, dx, dw, db, rm, rv)."""
    results = []
    for impl, dtype in ((bn.batch_norm, x.dtype), (F.batch_norm, x.dtype),
                        (F.batch_norm, torch.float64)):
        xi = x.detach().to(dtype).requires_grad_(True)
        wdtype = torch.float64 if dtype == torch.float64 else w.dtype
        wi = w.detach().to(wdtype).requires_grad_(True)
        bi = b.detach().to(wi.dtype).requires_grad_(True)
        rmi = rm.detach().to(torch.float64 if dtype == torch.float64 else rm.dtype).clone()
        rvi = rv.detach().to(rmi.dtype).clone()
        if impl is F.batch_norm and dtype in LOW:  # PyTorch wants params of the input dtype
            wi = w.detach().float().requires_grad_(True)  # or fp32 (cuDNN's mixed mode)
            bi = b.detach().float().requires_grad_(True)
        y = impl(xi, rmi, rvi, wi, bi, training, momentum, eps)
        grad = (dy if dy is not None else torch.ones_like(y)).to(y.dtype)
        y.backward(grad)
        results.append((y.detach(), xi.grad, wi.grad, bi.grad, rmi, rvi))
    return results


# ------------------------------------------------------------------------------- gradcheck


@pytest.mark.parametrize("shape", [(3, 4, 5, 7), (2, 3, 1030), (5, 2)])
def test_gradcheck_float64_training(shape):
    g = gen("gradcheck-train", shape)
    x = randn(shape, g, torch.float64).requires_grad_(True)
    w = randn((shape[1],), g, torch.float64, mean=1.0, std=0.5).requires_grad_(True)
    b = randn((shape[1],), g, torch.float64).requires_grad_(True)
    fn = lambda x, w, b: bn.batch_norm(x, None, None, w, b, True, 0.1, 1e-5)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w, b), eps=1e-6, atol=1e-5, rtol=1e-4)


def test_gradcheck_float64_eval():
    g = gen("gradcheck-eval")
    x = randn((3, 4, 6, 5), g, torch.float64).requires_grad_(True)
    w = randn((4,), g, torch.float64, mean=1.0).requires_grad_(True)
    b = randn((4,), g, torch.float64).requires_grad_(True)
    rm = randn((4,), g, torch.float64)
    rv = randn((4,), g, torch.float64).abs() + 0.5
    fn = lambda x, w, b: bn.batch_norm(x, rm, rv, w, b, False, 0.1, 1e-5)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w, b), eps=1e-6, atol=1e-5, rtol=1e-4)


def test_float64_matches_torch():
    g = gen("f64")
    x = randn((4, 6, 33, 35), g, torch.float64, mean=3.0, std=2.0)
    w, b = randn((6,), g, torch.float64), randn((6,), g, torch.float64)
    rm = torch.zeros(6, dtype=torch.float64, device="cuda")
    rv = torch.ones(6, dtype=torch.float64, device="cuda")
    for training in (True, False):
        ours, _, ref = run_both(x, w, b, rm, rv, training, dy=randn(x.shape, g, torch.float64))
        for name, a, r in zip(("y", "dx", "dweight", "dbias", "rm", "rv"), ours, ref):
            assert rel(a, r) < 1e-12, (training, name, rel(a, r))


# -------------------------------------------------------------------------- against torch


def tolerance(dtype):
    return {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_matches_torch(shape, dtype, training):
    g = gen("match", shape, dtype, training)
    x = randn(shape, g, dtype, mean=0.7, std=1.9)
    w, b, rm, rv = params(shape[1], g)
    dy = randn(shape, g, dtype)
    ours, torch_same, truth = run_both(x, w, b, rm, rv, training, momentum=0.3, dy=dy)
    names = ("y", "dx", "dweight", "dbias", "running_mean", "running_var")
    for name, a, t, r in zip(names, ours, torch_same, truth):
        err, torch_err = rel(a, r), rel(t, r)
        # Our error must be as small as PyTorch's in the same dtype (or under the dtype's
        # rounding level); dweight / dbias sums carry the inputs' rounding too.
        assert err <= max(2.0 * torch_err, tolerance(dtype)), (name, err, torch_err)


@pytest.mark.parametrize("shape", [(8, 4, 32, 33), (64, 3, 7, 7), (2, 2, 40, 40), (40, 72, 7, 7),
                                   (24, 72, 14, 14)], ids=str)
def test_large_mean_small_std(shape):
    """Mean 1e4, std 1e-2 in float32: sum / sum-of-squares would cancel completely."""
    g = gen("shifted", shape)
    x = randn(shape, g, torch.float32, mean=1e4, std=1e-2)
    c = shape[1]
    w = torch.ones(c, device="cuda")
    b = torch.zeros(c, device="cuda")
    rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
    xd = x.double()
    dims = [0] + list(range(2, x.dim()))
    true_mean = xd.mean(dims)
    true_var = xd.var(dims, unbiased=False)
    count = x.numel() // c
    y, save_mean, save_invstd = bn.train_forward(x.contiguous(), w, b, rm, rv, 1.0, 1e-5)
    # Statistics: as exact as float32 can hold them.
    assert ((save_mean.double() - true_mean).abs() <= 1e-3).all()
    assert rel(save_invstd, torch.rsqrt(true_var + 1e-5)) < 1e-5
    assert rel(rv, true_var * count / (count - 1)) < 1e-5
    # Output: limited by rounding the mean to float32 (half an ulp of 1e4, over std 1e-2),
    # the same for PyTorch.
    ours, torch_same, truth = run_both(x, w, b, torch.zeros(c, device="cuda"),
                                       torch.ones(c, device="cuda"), True, momentum=0.5,
                                       dy=randn(shape, g))
    for name, a, t, r in zip(("y", "dx", "dweight", "dbias", "rm", "rv"), ours, torch_same, truth):
        err, torch_err = rel(a, r), rel(t, r)
        assert err <= max(1.5 * torch_err, 1e-4), (name, err, torch_err)
    # Eval from these running statistics: the unfolded kernel keeps the same accuracy; the
    # folded FusedBatchNorm form x * scale + bias cannot (documented).
    rm_e, rv_e = save_mean.clone(), (1 / save_invstd.double() ** 2 - 1e-5).float()
    y_e = bn.eval_forward(x.contiguous(), w, b, rm_e, rv_e, 1e-5, fold=False)
    ref_e = F.batch_norm(xd, rm_e.double(), rv_e.double(), w.double(), b.double(), False, 0.0, 1e-5)
    torch_e = F.batch_norm(x, rm_e, rv_e, w, b, False, 0.0, 1e-5)
    assert rel(y_e, ref_e) <= max(1.5 * rel(torch_e, ref_e), 1e-4), (rel(y_e, ref_e),
                                                                      rel(torch_e, ref_e))


# ------------------------------------------------------------- raw calls: poison, alignment


class Guarded:
    """A tensor `offset` elements into a NaN-filled buffer, with a NaN guard after it."""

    def __init__(self, shape, dtype, offset):
        numel = 1
        for d in shape:
            numel *= d
        self.offset, self.numel = offset, numel
        self.buffer = torch.full((offset + numel + 1,), float("nan"), dtype=dtype, device="cuda")
        self.tensor = self.buffer[offset:offset + numel].view(shape)

    def intact(self) -> bool:
        guards = torch.cat([self.buffer[:self.offset], self.buffer[self.offset + self.numel:]])
        return bool(torch.isnan(guards.float()).all())


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(3, 5, 1029), (4, 3, 7, 7), (2, 6, 40, 41), (5, 3, 2048), (4, 72, 7, 7),
                                   (4, 72, 14, 14)],
                         ids=str)
@pytest.mark.parametrize("x_off,y_off", [(0, 0), (1, 1), (1, 2), (3, 0)])
def test_raw_offsets_and_poison(shape, dtype, x_off, y_off):
    g = gen("raw", shape, dtype, x_off, y_off)
    c = shape[1]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    xg = Guarded(shape, dtype, x_off)
    xg.tensor.copy_(randn(shape, g, dtype, mean=-2.0, std=3.0))
    x = xg.tensor
    assert x.data_ptr() % 16 == (x_off * x.element_size()) % 16
    w, b, rm, rv = (t.to(acc) for t in params(c, g))
    ref_rm, ref_rv = rm.double().clone(), rv.double().clone()
    y = Guarded(shape, dtype, y_off)
    sm, si = Guarded((c,), acc, 1), Guarded((c,), acc, 0)
    bn.train_forward(x, w, b, rm, rv, 0.25, 1e-3, y=y.tensor, save_mean=sm.tensor,
                     save_invstd=si.tensor)
    torch.cuda.synchronize()
    ref = F.batch_norm(x.double(), ref_rm, ref_rv, w.double(), b.double(), True, 0.25, 1e-3)
    assert y.intact() and sm.intact() and si.intact()
    tol = {torch.float64: 1e-12, torch.float32: 1e-6}.get(dtype, 1e-2)
    assert rel(y.tensor, ref) < tol
    assert rel(rm, ref_rm) < max(tol, 1e-6) and rel(rv, ref_rv) < max(tol, 1e-6)

    # Backward, outputs poisoned, dy at yet another offset.
    dyg = Guarded(shape, dtype, (y_off + 1) % 3)
    dyg.tensor.copy_(randn(shape, g, dtype))
    dx = Guarded(shape, dtype, x_off)
    dw, db = Guarded((c,), acc, 1), Guarded((c,), acc, 2)
    bn.backward(dyg.tensor, x, w, sm.tensor, si.tensor, True, dx=dx.tensor, dweight=dw.tensor,
                dbias=db.tensor)
    torch.cuda.synchronize()
    xd = x.double().requires_grad_(True)
    wd, bd = w.double().requires_grad_(True), b.double().requires_grad_(True)
    F.batch_norm(xd, None, None, wd, bd, True, 0.0, 1e-3).backward(dyg.tensor.double())
    assert dx.intact() and dw.intact() and db.intact()
    assert rel(dx.tensor, xd.grad) < tol * 4
    assert rel(dw.tensor, wd.grad) < max(tol, 1e-5) * 4
    assert rel(db.tensor, bd.grad) < max(tol, 1e-5) * 4

    # Eval forward (folded and unfolded) and eval backward (dx only: x is not read).
    ye = Guarded(shape, dtype, y_off)
    bn.eval_forward(x, w, b, rm, rv, 1e-3, y=ye.tensor)
    yu = Guarded(shape, dtype, x_off)
    bn.eval_forward(x, w, b, rm, rv, 1e-3, y=yu.tensor, fold=False)
    invstd = torch.rsqrt(rv + 1e-3)
    dxe = Guarded(shape, dtype, y_off)
    bn.backward(dyg.tensor, x, w, rm, invstd, False, need_dweight=False, need_dbias=False,
                dx=dxe.tensor)
    torch.cuda.synchronize()
    ref_e = F.batch_norm(x.double(), rm.double(), rv.double(), w.double(), b.double(), False, 0.0,
                         1e-3)
    assert ye.intact() and dxe.intact() and yu.intact()
    # Eval folds scale and bias into x's dtype for FusedBatchNorm: one more rounding.
    assert rel(ye.tensor, ref_e) < tol * 4
    assert rel(yu.tensor, ref_e) < tol * 2
    per_channel = (w.double() * invstd.double()).view(1, c, *[1] * (len(shape) - 2))
    ref_dxe = dyg.tensor.double() * per_channel
    assert rel(dxe.tensor, ref_dxe) < tol * 4


def test_raw_rejects_bad_arguments(lib):
    x = torch.randn(2, 3, 4, device="cuda")
    ws = torch.empty(lib.dk_batch_norm_workspace_bytes(0, 2, 3, 4), dtype=torch.uint8,
                     device="cuda")
    s = torch.cuda.current_stream().cuda_stream
    y, m, i = torch.empty_like(x), torch.empty(3, device="cuda"), torch.empty(3, device="cuda")
    call = lambda dtype, ws_bytes, n=2: lib.dk_batch_norm_train_forward_cuda(  # noqa: E731
        dtype, x.data_ptr(), None, None, None, None, 0.1, 1e-5, y.data_ptr(), m.data_ptr(),
        i.data_ptr(), ws.data_ptr(), ws_bytes, n, 3, 4, s)
    assert call(0, ws.numel()) == kernels.OK
    assert call(9, ws.numel()) == kernels.INVALID_ARGUMENT
    assert call(0, ws.numel() - 1) == kernels.INVALID_ARGUMENT
    assert call(0, ws.numel(), n=-1) == kernels.INVALID_ARGUMENT
    one = lib.dk_batch_norm_train_forward_cuda(0, x.data_ptr(), None, None, None, None, 0.1, 1e-5,
                                               y.data_ptr(), m.data_ptr(), i.data_ptr(),
                                               ws.data_ptr(), ws.numel(), 1, 3, 1, s)
    assert one == kernels.INVALID_ARGUMENT  # one value per channel
    torch.cuda.synchronize()


# ------------------------------------------------------------------- running statistics


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_running_stats_over_steps(dtype):
    g = gen("steps", dtype)
    c = 6
    rm_o, rv_o = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
    rm_t, rv_t = rm_o.clone(), rv_o.clone()
    w, b = torch.ones(c, device="cuda"), torch.zeros(c, device="cuda")
    for step in range(4):
        x = randn((8, c, 9, 11), g, dtype, mean=step, std=1 + step)
        bn.batch_norm(x, rm_o, rv_o, w, b, True, 0.2, 1e-5)
        F.batch_norm(x.float(), rm_t, rv_t, w, b, True, 0.2, 1e-5)
    assert rel(rm_o, rm_t) < 1e-5 and rel(rv_o, rv_t) < 1e-5


def test_no_affine_and_no_running_stats():
    g = gen("plain")
    x = randn((4, 5, 12, 13), g)
    y = bn.batch_norm(x, None, None, None, None, True)
    ref = F.batch_norm(x.double(), None, None, None, None, True)
    assert rel(y, ref) < 1e-6


# -------------------------------------------------------------------------- CUDA graphs


def test_cuda_graph_capture():
    g = gen("graph")
    c = 8
    static_x = randn((16, c, 40, 40), g).requires_grad_(True)
    w = torch.ones(c, device="cuda", requires_grad=True)
    b = torch.zeros(c, device="cuda", requires_grad=True)
    rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
    static_dy = randn((16, c, 40, 40), g)

    def step():
        y = bn.batch_norm(static_x, rm, rv, w, b, True, 0.1, 1e-5)
        y.backward(static_dy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            static_x.grad = w.grad = b.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    static_x.grad = w.grad = b.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()
    for trial in range(2):
        new_x = randn((16, c, 40, 40), g, mean=trial, std=2.0)
        with torch.no_grad():
            static_x.copy_(new_x)
        static_dy.copy_(randn((16, c, 40, 40), g))
        graph.replay()
        torch.cuda.synchronize()
        xd = new_x.double().requires_grad_(True)
        wd, bd = w.detach().double().requires_grad_(True), b.detach().double().requires_grad_(True)
        ref = F.batch_norm(xd, None, None, wd, bd, True)
        ref.backward(static_dy.double())
        assert rel(static_y, ref) < 1e-6
        assert rel(static_x.grad, xd.grad) < 1e-5
        assert rel(w.grad, wd.grad) < 1e-5 and rel(b.grad, bd.grad) < 1e-5


# ------------------------------------------------------------------------------ module


@pytest.fixture
def no_tf32():
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def test_replace_batch_norm_matches_torch_model(no_tf32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Sequential(torch.nn.Conv2d(8, 4, 3), torch.nn.BatchNorm2d(4, momentum=None)),
        torch.nn.Flatten()).cuda()
    ours = bn.replace_batch_norm(copy.deepcopy(model))
    assert isinstance(ours[1], bn.BatchNorm2d) and isinstance(ours[3][1], bn.BatchNorm2d)
    assert ours[1].weight is not model[1].weight  # deepcopy first
    x = torch.randn(6, 3, 17, 19, device="cuda")
    for m in (model, ours):
        m.train()
    for step in range(3):
        xs = x * (step + 1) + step
        ya, yb = model(xs), ours(xs)
        assert rel(yb, ya) < 1e-5, (step, rel(yb, ya))
        (ya.square() * torch.arange(ya.shape[1], device="cuda")).sum().backward()
        (yb.square() * torch.arange(yb.shape[1], device="cuda")).sum().backward()
    # Conv biases right before a training-mode BatchNorm have gradient 0 in exact arithmetic
    # (rounding noise in both): compare every gradient against the largest one.
    scale = max(float(p.grad.norm()) for p in model.parameters())
    for (na, pa), (nb_, pb) in zip(model.named_parameters(), ours.named_parameters()):
        err = float((pb.grad - pa.grad).norm()) / scale
        assert err < 1e-5 or rel(pb.grad, pa.grad) < 1e-4, (na, err, rel(pb.grad, pa.grad))
    for (na, ba), (_, bb) in zip(model.named_buffers(), ours.named_buffers()):
        assert rel(bb.float(), ba.float()) < 1e-5, (na, rel(bb.float(), ba.float()))
    model.eval()
    ours.eval()
    assert rel(ours(x), model(x)) < 1e-5, rel(ours(x), model(x))
    # CPU inputs fall back to PyTorch.
    cpu = ours.cpu()
    assert torch.isfinite(cpu(x.cpu())).all()
