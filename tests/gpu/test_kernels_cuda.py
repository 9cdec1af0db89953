"""CUDA kernels of csrc/kernels (FusedBatchNorm, MatMulRelu) on the GPU, against float64
references computed on the CPU.

Runs on torch CUDA tensors (data_ptr(), torch.cuda.current_stream()). MatMulRelu is checked
through cuBLASLt and through the fallback kernel (forced with
dk_matmul_relu_cuda_force_fallback, and with DEPLOYKIT_DISABLE_CUBLASLT=1 in a subprocess).
Outputs are poisoned with NaN first, and sit between NaN guard elements that must survive.
The library is built once per session for this GPU's architecture.
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess
import sys
import textwrap
import zlib

import pytest

torch = pytest.importorskip("torch")

from deploykit.native import kernels  # noqa: E402

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CODE = {"float32": kernels.FLOAT32, "float16": kernels.FLOAT16, "bfloat16": kernels.BFLOAT16}
MANTISSA_BITS = {"float32": 23, "float16": 10, "bfloat16": 7}
MIN_NORMAL_EXP = {"float32": -126, "float16": -14, "bfloat16": -126}
CUBLASLT, FALLBACK = 0, 1


def find_cublaslt_library() -> str | None:
    """libcublasLt.so.13 from pip's nvidia packages (what torch uses), if there."""
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        found = sorted(glob.glob(os.path.join(root, "*", "lib", "libcublasLt.so.*")))
        if found:
            return found[0]
    return None


@pytest.fixture(scope="session")
def lib(tmp_path_factory) -> ctypes.CDLL:
    if shutil.which("cmake") is None:
        pytest.skip("cmake not found: cannot build the kernel library")
    major, minor = torch.cuda.get_device_capability()
    path = kernels.build_library(tmp_path_factory.mktemp("kernels-cuda-build"),
                                 cuda_architectures=f"{major}{minor}")
    if "DEPLOYKIT_CUBLASLT_LIB" not in os.environ and (found := find_cublaslt_library()):
        os.environ["DEPLOYKIT_CUBLASLT_LIB"] = found  # read at the library's first matmul
    library = kernels.load(path)
    probe = library.dk_fused_batch_norm_cuda(0, None, None, None, None, 0, 0, 0, 0, None)
    if probe == kernels.NOT_COMPILED:
        pytest.fail("the kernel library was built without CUDA although a GPU is present")
    return library


@pytest.fixture
def cublaslt(lib):
    if not lib.dk_cublaslt_available():
        pytest.skip("cuBLASLt could not be loaded (set DEPLOYKIT_CUBLASLT_LIB)")
    lib.dk_matmul_relu_cuda_force_fallback(0)
    return lib


@pytest.fixture
def fallback(lib):
    lib.dk_matmul_relu_cuda_force_fallback(1)
    yield lib
    lib.dk_matmul_relu_cuda_force_fallback(0)


# ---------------------------------------------------------------------------------- helpers


def generator(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def random_operand(gen, shape, dtype: str, scale: float = 1.0):
    """(GPU tensor of `dtype`, its exact float64 values on the CPU)."""
    t = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(DTYPES[dtype])
    return t.cuda(), t.double()


class Guarded:
    """A tensor placed `offset` elements into a NaN-filled buffer with one NaN guard element
    after it: offset 1 makes it misaligned. `intact()` says whether the guards survived."""

    def __init__(self, shape, dtype: str, offset: int, values: torch.Tensor | None = None):
        numel = 1
        for d in shape:
            numel *= d
        self.offset, self.numel = offset, numel
        self.buffer = torch.full((offset + numel + 1,), float("nan"), dtype=DTYPES[dtype],
                                 device="cuda")
        self.tensor = self.buffer[offset:offset + numel].view(shape)
        if values is not None:
            self.tensor.copy_(values)

    def intact(self) -> bool:
        guards = torch.cat([self.buffer[:self.offset], self.buffer[self.offset + self.numel:]])
        return bool(torch.isnan(guards).all())


def ulp(values: torch.Tensor, dtype: str) -> torch.Tensor:
    exponent = torch.floor(torch.log2(values.abs().clamp_min(2.0 ** MIN_NORMAL_EXP[dtype])))
    return torch.exp2(exponent - MANTISSA_BITS[dtype])


def assert_written_and_close(y: torch.Tensor, ref, tol, what):
    got = y.double().cpu()
    assert not torch.isnan(got).any(), f"{what}: {int(torch.isnan(got).sum())} outputs not written"
    err = (got - ref).abs()
    bad = err > tol
    if bad.any():
        i = int(torch.argmax((err - tol).flatten()))
        pytest.fail(f"{what}: {int(bad.sum())} of {bad.numel()} outside tolerance; worst: got "
                    f"{got.flatten()[i].item()!r}, expected {ref.flatten()[i].item()!r}, "
                    f"tolerance {tol.flatten()[i].item()!r}")


def stream_handle(stream=None) -> int:
    return (stream or torch.cuda.current_stream()).cuda_stream


# ----------------------------------------------------------------------------- FusedBatchNorm

BN_SHAPES = [(1, 1), (3, 17), (1, 1, 1), (3, 17, 1), (3, 17, 7), (1, 3, 33), (3, 1, 1003),
             (1, 17, 1003), (3, 3, 5, 7), (2, 64, 56 * 56 + 3), (4, 3, 224 * 224)]


def run_batch_norm(lib, dtype, x, scale, bias, y, activation, stream=None):
    spatial = 1
    for d in x.shape[2:]:
        spatial *= d
    status = lib.dk_fused_batch_norm_cuda(CODE[dtype], x.data_ptr(), scale.data_ptr(),
                                          bias.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1],
                                          spatial, kernels.ACTIVATIONS[activation],
                                          stream_handle(stream))
    kernels.check(status, "dk_fused_batch_norm_cuda", lib)


def batch_norm_reference(x64, scale64, bias64, activation):
    shape = (1, -1) + (1,) * (x64.dim() - 2)
    prod = x64 * scale64.view(shape)
    ref = prod + bias64.view(shape)
    if activation == "relu":
        ref = ref.clamp_min(0.0)
    return ref, prod.abs() + bias64.view(shape).abs()


@pytest.mark.parametrize("activation", ["none", "relu"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", BN_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_batch_norm(lib, shape, dtype, activation):
    gen = generator(shape, dtype, activation)
    x_values, x64 = random_operand(gen, shape, dtype, 3.0)
    scale, scale64 = random_operand(gen, (shape[1],), dtype)
    bias, bias64 = random_operand(gen, (shape[1],), dtype)
    ref, magnitude = batch_norm_reference(x64, scale64, bias64, activation)
    tol = ulp(ref, dtype) + 2.0**-22 * magnitude
    # (x offset, y offset) in elements: aligned, both misaligned alike, misaligned differently
    for x_offset, y_offset in [(0, 0), (1, 1), (0, 1), (1, 0), (3, 3)]:
        x = Guarded(shape, dtype, x_offset, x_values)
        y = Guarded(shape, dtype, y_offset)
        run_batch_norm(lib, dtype, x.tensor, scale, bias, y.tensor, activation)
        torch.cuda.synchronize()
        what = f"{dtype} {shape} {activation} offsets x={x_offset} y={y_offset}"
        assert_written_and_close(y.tensor, ref, tol, what)
        assert y.intact(), f"{what}: wrote outside the output"
        assert torch.equal(x.tensor.cpu(), x_values.cpu()), f"{what}: input modified"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("offset", [0, 1])
def test_fused_batch_norm_in_place(lib, dtype, offset):
    shape = (3, 17, 333)
    gen = generator("in place", dtype, offset)
    x_values, x64 = random_operand(gen, shape, dtype, 3.0)
    scale, scale64 = random_operand(gen, (17,), dtype)
    bias, bias64 = random_operand(gen, (17,), dtype)
    x = Guarded(shape, dtype, offset, x_values)
    run_batch_norm(lib, dtype, x.tensor, scale, bias, x.tensor, "relu")
    torch.cuda.synchronize()
    ref, magnitude = batch_norm_reference(x64, scale64, bias64, "relu")
    assert_written_and_close(x.tensor, ref, ulp(ref, dtype) + 2.0**-22 * magnitude, "in place")
    assert x.intact()


def test_fused_batch_norm_matches_cpu_kernel(lib):
    """GPU and CPU kernels agree to 1 ulp (the GPU fuses x * s + b into one FMA)."""
    import numpy as np

    gen = generator("cpu match")
    x, _ = random_operand(gen, (2, 5, 1001), "float16", 3.0)
    scale, _ = random_operand(gen, (5,), "float16")
    bias, _ = random_operand(gen, (5,), "float16")
    y = torch.full_like(x, float("nan"))
    run_batch_norm(lib, "float16", x, scale, bias, y, "relu")
    cpu = kernels.fused_batch_norm_cpu(x.cpu().numpy(), scale.cpu().numpy(), bias.cpu().numpy(),
                                       "relu", lib=lib)
    got = y.cpu().numpy()
    diff = np.abs(got.view(np.int16).astype(np.int32) - cpu.view(np.int16).astype(np.int32))
    assert diff.max() <= 1


def test_fused_batch_norm_side_stream(lib):
    gen = generator("stream")
    x, x64 = random_operand(gen, (8, 32, 4096), "float32")
    scale, scale64 = random_operand(gen, (32,), "float32")
    bias, bias64 = random_operand(gen, (32,), "float32")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = torch.full_like(x, float("nan"))
        run_batch_norm(lib, "float32", x, scale, bias, y, "none", stream=side)
    side.synchronize()
    ref, magnitude = batch_norm_reference(x64, scale64, bias64, "none")
    assert_written_and_close(y, ref, ulp(ref, "float32") + 2.0**-22 * magnitude, "side stream")


@pytest.mark.slow
def test_fused_batch_norm_64bit_indices(lib):
    """More than 2^31 elements (the kernel's 64-bit index path), in place, fp16, misaligned
    start; checked against torch's fp32 math on the GPU (1 ulp: FMA vs separate rounding)."""
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs ~13 GiB of GPU memory")
    channels, spatial = 3, (2**31 // 3) + 1001
    x = Guarded((1, channels, spatial), "float16", 1)
    x.tensor.normal_()
    scale = torch.randn(channels, device="cuda").half()
    bias = torch.randn(channels, device="cuda").half()
    ref = torch.empty_like(x.tensor)
    for c in range(channels):  # torch reference, one channel at a time to bound memory
        ref[0, c] = torch.relu(x.tensor[0, c].float() * scale[c].float() + bias[c].float()).half()
    run_batch_norm(lib, "float16", x.tensor, scale, bias, x.tensor, "relu")
    torch.cuda.synchronize()
    assert x.intact()
    for c in range(channels):
        diff = (x.tensor[0, c].view(torch.int16).int() - ref[0, c].view(torch.int16).int()).abs()
        assert int(diff.max()) <= 1, f"channel {c}"


def test_fused_batch_norm_bad_arguments(lib):
    x = torch.zeros(2, 3, 4, device="cuda")
    s = torch.zeros(3, device="cuda")
    bn = lib.dk_fused_batch_norm_cuda
    p, sp = x.data_ptr(), s.data_ptr()
    assert bn(5, p, sp, sp, p, 2, 3, 4, 0, None) == kernels.INVALID_ARGUMENT
    assert bn(0, p + 2, sp, sp, p + 2, 2, 3, 1, 0, None) == kernels.INVALID_ARGUMENT  # misaligned
    assert bn(0, p, sp, sp, p + 4, 1, 3, 4, 0, None) == kernels.INVALID_ARGUMENT  # overlap
    assert bn(0, p, sp, sp, p, 0, 3, 4, 0, None) == kernels.OK  # empty


# -------------------------------------------------------------------------------- MatMulRelu

MATMUL_SIZES = [1, 3, 17, 64, 129]


def run_matmul(lib, dtype, a, b, bias, y, allow_tf32=False, workspace=None, stream=None):
    m, k = a.shape
    n = b.shape[1]
    ws_ptr, ws_bytes = (workspace.data_ptr(), workspace.numel()) if workspace is not None else (
        None, 0)
    status = lib.dk_matmul_relu_cuda(CODE[dtype], a.data_ptr(), b.data_ptr(),
                                     None if bias is None else bias.data_ptr(), y.data_ptr(),
                                     m, k, n, int(allow_tf32), ws_ptr, ws_bytes,
                                     stream_handle(stream))
    kernels.check(status, "dk_matmul_relu_cuda", lib)
    return lib.dk_matmul_relu_cuda_last_path()


def matmul_reference(a64, b64, bias64):
    ref = a64 @ b64
    magnitude = a64.abs() @ b64.abs()
    if bias64 is not None:
        ref = ref + bias64
        magnitude = magnitude + bias64.abs()
    return ref.clamp_min(0.0), magnitude


def check_matmul(lib, dtype, m, k, n, with_bias, offset=0, allow_tf32=False, workspace=None):
    """Runs one product with fresh inputs (at `offset` elements, so 1 = misaligned) and checks
    it; returns the path that ran."""
    gen = generator(dtype, m, k, n, with_bias, offset)
    a_values, a64 = random_operand(gen, (m, k), dtype)
    b_values, b64 = random_operand(gen, (k, n), dtype)
    a = Guarded((m, k), dtype, offset, a_values)
    b = Guarded((k, n), dtype, offset, b_values)
    bias = bias64 = None
    if with_bias:
        bias_values, bias64 = random_operand(gen, (n,), dtype)
        bias = Guarded((n,), dtype, offset, bias_values).tensor
    y = Guarded((m, n), dtype, offset)
    path = run_matmul(lib, dtype, a.tensor, b.tensor, bias, y.tensor, allow_tf32, workspace)
    torch.cuda.synchronize()
    ref, magnitude = matmul_reference(a64, b64, bias64)
    tol = ulp(ref, dtype) + (k + 1) * 2.0**-23 * magnitude
    if allow_tf32:  # inputs rounded to 10 mantissa bits
        tol = tol + 2.0**-9 * magnitude
    what = f"{dtype} m={m} k={k} n={n} bias={with_bias} offset={offset} path={path}"
    assert_written_and_close(y.tensor, ref, tol, what)
    assert y.intact(), f"{what}: wrote outside the output"
    return path


@pytest.fixture(scope="module")
def workspace(lib):
    return torch.empty(lib.dk_matmul_relu_cuda_workspace_bytes(), dtype=torch.uint8,
                       device="cuda")


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_matmul_relu_cublaslt(cublaslt, workspace, dtype, with_bias):
    paths = {}
    for m in MATMUL_SIZES:
        for k in MATMUL_SIZES:
            for n in MATMUL_SIZES:
                paths[m, k, n] = check_matmul(cublaslt, dtype, m, k, n, with_bias,
                                              workspace=workspace)
    for shape in [(64, 64, 64), (512, 768, 1024)]:
        paths[shape] = check_matmul(cublaslt, dtype, *shape, with_bias, workspace=workspace)
        assert paths[shape] == CUBLASLT, f"{shape}: cuBLASLt did not run an aligned problem"
    fell_back = sorted(s for s, p in paths.items() if p != CUBLASLT)
    print(f"{dtype} bias={with_bias}: {len(fell_back)} of {len(paths)} shapes fell back: "
          f"{fell_back[:10]}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_matmul_relu_cublaslt_misaligned_and_no_workspace(cublaslt, workspace, dtype):
    for shape in [(64, 64, 64), (17, 33, 129), (256, 128, 96)]:
        for with_bias in (False, True):
            check_matmul(cublaslt, dtype, *shape, with_bias, offset=1, workspace=workspace)
            path = check_matmul(cublaslt, dtype, *shape, with_bias, workspace=None)
            if shape[0] % 8 == 0:
                assert path == CUBLASLT


@pytest.mark.parametrize("path", ["cublaslt", "fallback"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_matmul_relu_bias_added_before_rounding(lib, workspace, dtype, path):
    """Bias cancelling most of a @ b: the result must come from the fp32 sum rounded once, not
    from a @ b rounded to the output type and then added to the bias (some cuBLASLt bf16
    epilogue kernels do that)."""
    if path == "cublaslt" and not lib.dk_cublaslt_available():
        pytest.skip("cuBLASLt could not be loaded")
    lib.dk_matmul_relu_cuda_force_fallback(int(path == "fallback"))
    try:
        for m, k, n in [(17, 3, 3), (128, 64, 64), (256, 512, 96)]:
            gen = generator("cancel", dtype, m, k, n)
            row, row64 = random_operand(gen, (1, k), dtype, 4.0)
            a, a64 = row.expand(m, k).contiguous(), row64.expand(m, k)  # identical rows
            b, b64 = random_operand(gen, (k, n), dtype)
            small = 0.05 * torch.rand(n, generator=gen, dtype=torch.float64)
            bias64 = (-(row64 @ b64)[0] + small).to(DTYPES[dtype]).double()
            bias = bias64.to(DTYPES[dtype]).cuda()
            y = torch.full((m, n), float("nan"), dtype=DTYPES[dtype], device="cuda")
            used = run_matmul(lib, dtype, a, b, bias, y, workspace=workspace)
            torch.cuda.synchronize()
            assert used == (FALLBACK if path == "fallback" else CUBLASLT) or m % 8
            ref, magnitude = matmul_reference(a64, b64, bias64)
            tol = ulp(ref, dtype) + (k + 1) * 2.0**-23 * magnitude
            assert_written_and_close(y, ref, tol, f"{dtype} {m}x{k}x{n} path={used}")
    finally:
        lib.dk_matmul_relu_cuda_force_fallback(0)


def test_matmul_relu_tf32(cublaslt, workspace):
    for shape in [(64, 64, 64), (300, 1000, 200)]:
        check_matmul(cublaslt, "float32", *shape, True, allow_tf32=True, workspace=workspace)


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_matmul_relu_fallback(fallback, dtype, with_bias):
    for m in MATMUL_SIZES:
        for k in MATMUL_SIZES:
            for n in MATMUL_SIZES:
                assert check_matmul(fallback, dtype, m, k, n, with_bias) == FALLBACK
    for shape in [(512, 768, 1024), (70, 1, 3000)]:
        assert check_matmul(fallback, dtype, *shape, with_bias, offset=1) == FALLBACK


@pytest.mark.parametrize("path", ["cublaslt", "fallback"])
def test_matmul_relu_empty_reduction(lib, path):
    lib.dk_matmul_relu_cuda_force_fallback(int(path == "fallback"))
    try:
        bias = torch.tensor([-1.0, 0.5, 2.0], device="cuda")
        a = torch.empty(4, 0, device="cuda")
        b = torch.empty(0, 3, device="cuda")
        y = torch.full((4, 3), float("nan"), device="cuda")
        assert run_matmul(lib, "float32", a, b, bias, y) == FALLBACK  # k = 0 always falls back
        torch.cuda.synchronize()
        assert torch.equal(y.cpu(), torch.tensor([[0.0, 0.5, 2.0]] * 4))
    finally:
        lib.dk_matmul_relu_cuda_force_fallback(0)


def test_matmul_relu_side_stream(lib, workspace):
    gen = generator("mm stream")
    a, a64 = random_operand(gen, (256, 512), "bfloat16")
    b, b64 = random_operand(gen, (512, 384), "bfloat16")
    bias, bias64 = random_operand(gen, (384,), "bfloat16")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = torch.full((256, 384), float("nan"), dtype=torch.bfloat16, device="cuda")
        run_matmul(lib, "bfloat16", a, b, bias, y, workspace=workspace, stream=side)
    side.synchronize()
    ref, magnitude = matmul_reference(a64, b64, bias64)
    assert_written_and_close(y, ref, ulp(ref, "bfloat16") + 513 * 2.0**-23 * magnitude, "stream")


def test_disable_cublaslt_environment_variable(lib):
    """DEPLOYKIT_DISABLE_CUBLASLT=1 (read at first use) keeps cuBLASLt unloaded."""
    library = lib._name  # the path the fixture loaded
    script = textwrap.dedent(f"""
        import torch
        from deploykit.native import kernels
        lib = kernels.load({library!r})
        a = torch.randn(64, 64, device="cuda")
        y = torch.full((64, 64), float("nan"), device="cuda")
        status = lib.dk_matmul_relu_cuda(0, a.data_ptr(), a.data_ptr(), None, y.data_ptr(),
                                         64, 64, 64, 0, None, 0,
                                         torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        ok = torch.allclose(y, torch.relu(a.double() @ a.double()).float(), rtol=1e-4, atol=1e-4)
        print(status, lib.dk_cublaslt_available(), lib.dk_matmul_relu_cuda_last_path(), ok)
    """)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, DEPLOYKIT_DISABLE_CUBLASLT="1",
               PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "0", str(FALLBACK), "True"], done.stdout


def test_matmul_relu_bad_arguments(lib):
    x = torch.zeros(4, 4, device="cuda")
    p = x.data_ptr()
    mm = lib.dk_matmul_relu_cuda
    assert mm(7, p, p, None, p, 2, 2, 2, 0, None, 0, None) == kernels.INVALID_ARGUMENT
    assert mm(0, p, p, None, None, 2, 2, 2, 0, None, 0, None) == kernels.INVALID_ARGUMENT
    assert mm(0, p + 2, p, None, p, 2, 2, 2, 0, None, 0, None) == kernels.INVALID_ARGUMENT
    assert mm(0, None, None, None, None, 0, 2, 2, 0, None, 0, None) == kernels.OK
