"""CPU kernels of csrc/kernels (FusedBatchNorm, MatMulRelu) against float64 references.

The library is built once per session with CMake (CUDA sources too when nvcc exists, for sm_90
only to keep the build short). Every output is poisoned with NaN before the call, so an element
the kernel skips fails the comparison.
"""

from __future__ import annotations

import ctypes
import shutil
import zlib

import numpy as np
import pytest
import torch

from deploykit.native import kernels

DTYPES = ["float32", "float16", "bfloat16"]
CODE = {"float32": kernels.FLOAT32, "float16": kernels.FLOAT16, "bfloat16": kernels.BFLOAT16}
MANTISSA_BITS = {"float32": 23, "float16": 10, "bfloat16": 7}
MIN_NORMAL_EXP = {"float32": -126, "float16": -14, "bfloat16": -126}
NAN_BITS = {"float16": 0x7E00, "bfloat16": 0x7FC0}


@pytest.fixture(scope="session")
def lib(tmp_path_factory) -> ctypes.CDLL:
    if shutil.which("cmake") is None:
        pytest.skip("cmake not found: cannot build the kernel library")
    path = kernels.build_library(tmp_path_factory.mktemp("kernels-build"), cuda_architectures="90")
    return kernels.load(path)


# ---------------------------------------------------------------------------------- helpers


def encode(values: np.ndarray, dtype: str) -> np.ndarray:
    """float values -> the array the kernels take (bfloat16 as uint16 bits, rounded by torch)."""
    if dtype == "bfloat16":
        t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.bfloat16)
        return t.view(torch.int16).numpy().view(np.uint16).copy()
    return np.ascontiguousarray(values, dtype=np.dtype(dtype))


def decode(array: np.ndarray, dtype: str) -> np.ndarray:
    """The kernels' array -> float64 values."""
    with np.errstate(invalid="ignore"):  # NaN patterns
        if dtype == "bfloat16":
            return (array.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return array.astype(np.float64)


def poisoned(shape: tuple, dtype: str) -> np.ndarray:
    """An output array of `dtype` filled with NaN."""
    if dtype == "float32":
        return np.full(shape, np.nan, dtype=np.float32)
    bits = np.full(shape, NAN_BITS[dtype], dtype=np.uint16)
    return bits if dtype == "bfloat16" else bits.view(np.float16)


def seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def ulp(values: np.ndarray, dtype: str) -> np.ndarray:
    """Spacing of `dtype` at |values| (the subnormal spacing below the normal range)."""
    exponent = np.floor(np.log2(np.maximum(np.abs(values), 2.0 ** MIN_NORMAL_EXP[dtype])))
    return 2.0 ** (exponent - MANTISSA_BITS[dtype])


def random_operand(rng: np.random.Generator, shape: tuple, dtype: str, scale: float = 1.0):
    """(kernel array, its exact float64 values) for fresh random data rounded to `dtype`."""
    array = encode(rng.standard_normal(shape) * scale, dtype)
    return array, decode(array, dtype)


def assert_written_and_close(y: np.ndarray, ref: np.ndarray, tol: np.ndarray, dtype: str, what):
    got = decode(y, dtype)
    assert not np.isnan(got).any(), f"{what}: {np.isnan(got).sum()} outputs not written"
    err = np.abs(got - ref)
    bad = err > tol
    if bad.any():
        i = np.unravel_index(np.argmax(err - tol), err.shape)
        pytest.fail(f"{what}: {bad.sum()} of {bad.size} outside tolerance; worst at {i}: "
                    f"got {got[i]!r}, expected {ref[i]!r}, tolerance {tol[i]!r}")


# ----------------------------------------------------------------------------- FusedBatchNorm

BN_SHAPES = [(1, 1), (3, 17), (1, 1, 1), (3, 17, 1), (3, 17, 7), (1, 3, 33), (3, 1, 1003),
             (1, 17, 1003), (3, 3, 5, 7)]


def batch_norm_reference(x64, scale64, bias64, activation):
    shape = (1, -1) + (1,) * (x64.ndim - 2)
    prod = x64 * scale64.reshape(shape)
    ref = prod + bias64.reshape(shape)
    if activation == "relu":
        ref = np.maximum(ref, 0.0)
    # fp32 math (two roundings at most 2^-24 relative to |x s| + |b| each), then one rounding
    # to the output type: 1 ulp of the output plus the fp32 error.
    return ref, np.abs(prod) + np.abs(bias64.reshape(shape))


@pytest.mark.parametrize("activation", ["none", "relu"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", BN_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_batch_norm(lib, shape, dtype, activation):
    rng = np.random.default_rng(seed(shape, dtype, activation))
    x, x64 = random_operand(rng, shape, dtype, 3.0)
    scale, scale64 = random_operand(rng, (shape[1],), dtype)
    bias, bias64 = random_operand(rng, (shape[1],), dtype)
    y = poisoned(shape, dtype)
    out = kernels.fused_batch_norm_cpu(x, scale, bias, activation, out=y, lib=lib)
    assert out is y
    ref, magnitude = batch_norm_reference(x64, scale64, bias64, activation)
    tol = ulp(ref, dtype) + 2.0**-22 * magnitude
    assert_written_and_close(y, ref, tol, dtype, f"{dtype} {shape} {activation}")
    if activation == "relu":
        assert (decode(y, dtype) >= 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_batch_norm_in_place(lib, dtype):
    rng = np.random.default_rng(7)
    x, x64 = random_operand(rng, (3, 17, 33), dtype, 3.0)
    scale, scale64 = random_operand(rng, (17,), dtype)
    bias, bias64 = random_operand(rng, (17,), dtype)
    out = kernels.fused_batch_norm_cpu(x, scale, bias, "relu", out=x, lib=lib)
    assert out is x
    ref, magnitude = batch_norm_reference(x64, scale64, bias64, "relu")
    assert_written_and_close(x, ref, ulp(ref, dtype) + 2.0**-22 * magnitude, dtype, "in place")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_conversions_exhaustive(lib, dtype):
    """Every 16-bit pattern through x * 1 + 0: finite values and infinities come back bit for
    bit (both conversions are exact there), NaNs stay NaN."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    x = bits.reshape(1, 1, -1) if dtype == "bfloat16" else bits.view(np.float16).reshape(1, 1, -1)
    one = encode(np.ones(1), dtype)
    zero = encode(np.zeros(1), dtype)
    y = kernels.fused_batch_norm_cpu(x, one, zero, "none", lib=lib)
    got, want = y.reshape(-1).view(np.uint16), bits
    nan = np.isnan(decode(x.reshape(-1), dtype))
    assert np.isnan(decode(y.reshape(-1), dtype))[nan].all()
    # x * 1 + 0 turns -0 into +0 (IEEE: -0 + +0 = +0); everything else is unchanged
    want = np.where(want == 0x8000, 0, want)
    np.testing.assert_array_equal(got[~nan], want[~nan])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rounding_is_nearest_even(lib, dtype):
    """fp32 -> half rounding, exactly: with k = 1 a product of two half values is exact in fp32,
    so the output must be that product rounded once (ties to even, overflow to inf, subnormals
    and underflow included), as numpy (fp16) and torch (bf16) round."""
    rng = np.random.default_rng(3)
    if dtype == "float16":
        # all positive finite fp16 values, times random fp16 values of wide range
        a_bits = rng.integers(0x0001, 0x7C00, size=(20000, 1), dtype=np.uint16)
        b_bits = rng.integers(0x0001, 0x7C00, size=(1, 37), dtype=np.uint16)
        a, b = a_bits.view(np.float16), b_bits.view(np.float16)
        exact = a.astype(np.float32) @ b.astype(np.float32)
        with np.errstate(over="ignore"):  # overflow to inf is part of the test
            want = exact.astype(np.float16).view(np.uint16)
    else:
        a = encode(np.exp2(rng.uniform(-60, 60, (20000, 1))) * rng.uniform(1, 2, (20000, 1)),
                   dtype)
        b = encode(np.exp2(rng.uniform(-60, 60, (1, 37))) * rng.uniform(1, 2, (1, 37)), dtype)
        exact = decode(a, dtype).astype(np.float32) @ decode(b, dtype).astype(np.float32)
        want = encode(exact, dtype)
    y = kernels.matmul_relu_cpu(a, b, out=poisoned((20000, 37), dtype), lib=lib)
    np.testing.assert_array_equal(y.view(np.uint16), want)


# -------------------------------------------------------------------------------- MatMulRelu

MATMUL_SIZES = [1, 3, 17, 64, 129]


def matmul_reference(a64, b64, bias64):
    ref = a64 @ b64
    magnitude = np.abs(a64) @ np.abs(b64)
    if bias64 is not None:
        ref = ref + bias64
        magnitude = magnitude + np.abs(bias64)
    return np.maximum(ref, 0.0), magnitude


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_relu(lib, dtype, with_bias):
    rng = np.random.default_rng(11 + CODE[dtype] * 2 + with_bias)
    for m in MATMUL_SIZES:
        for k in MATMUL_SIZES:
            for n in MATMUL_SIZES:
                a, a64 = random_operand(rng, (m, k), dtype)
                b, b64 = random_operand(rng, (k, n), dtype)
                bias, bias64 = random_operand(rng, (n,), dtype) if with_bias else (None, None)
                y = poisoned((m, n), dtype)
                kernels.matmul_relu_cpu(a, b, bias, out=y, lib=lib)
                ref, magnitude = matmul_reference(a64, b64, bias64)
                # fp32 accumulation over k terms, then one rounding to the output type
                tol = ulp(ref, dtype) + (k + 1) * 2.0**-23 * magnitude
                assert_written_and_close(y, ref, tol, dtype, f"{dtype} m={m} k={k} n={n}")


def test_matmul_relu_batched_and_large(lib):
    rng = np.random.default_rng(5)
    a, a64 = random_operand(rng, (2, 5, 300), "float32")
    b, b64 = random_operand(rng, (300, 517), "float32")
    bias, bias64 = random_operand(rng, (517,), "float32")
    y = kernels.matmul_relu_cpu(a, b, bias, lib=lib)
    assert y.shape == (2, 5, 517)
    ref, magnitude = matmul_reference(a64.reshape(10, 300), b64, bias64)
    assert_written_and_close(y.reshape(10, 517), ref, ulp(ref, "float32") + 301 * 2.0**-23 *
                             magnitude, "float32", "batched")


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_relu_empty_reduction(lib, dtype):
    """k = 0: y = relu(bias), or zeros without a bias."""
    bias = encode(np.array([-1.0, 0.5, 2.0]), dtype)
    a = encode(np.zeros((4, 0)), dtype)
    b = encode(np.zeros((0, 3)), dtype)
    y = kernels.matmul_relu_cpu(a, b, bias, out=poisoned((4, 3), dtype), lib=lib)
    np.testing.assert_array_equal(decode(y, dtype), np.tile([0.0, 0.5, 2.0], (4, 1)))
    y = kernels.matmul_relu_cpu(a, b, out=poisoned((4, 3), dtype), lib=lib)
    np.testing.assert_array_equal(decode(y, dtype), np.zeros((4, 3)))


# --------------------------------------------------------------------- argument checks, ABI


def test_invalid_arguments(lib):
    x = np.ones((2, 3, 4), np.float32)
    s = np.ones(3, np.float32)
    p = x.ctypes.data
    bn = lib.dk_fused_batch_norm_cpu
    assert bn(kernels.FLOAT32, p, s.ctypes.data, s.ctypes.data, p, 2, 3, 4, 0) == kernels.OK
    assert bn(9, p, s.ctypes.data, s.ctypes.data, p, 2, 3, 4, 0) == kernels.INVALID_ARGUMENT
    assert bn(0, p, s.ctypes.data, s.ctypes.data, p, 2, 3, 4, 5) == kernels.INVALID_ARGUMENT
    assert bn(0, p, s.ctypes.data, s.ctypes.data, p, -2, 3, 4, 0) == kernels.INVALID_ARGUMENT
    assert bn(0, None, s.ctypes.data, s.ctypes.data, p, 2, 3, 4, 0) == kernels.INVALID_ARGUMENT
    assert bn(0, p + 2, s.ctypes.data, s.ctypes.data, p, 1, 1, 1, 0) == kernels.INVALID_ARGUMENT
    assert bn(0, p, s.ctypes.data, s.ctypes.data, p + 4, 1, 3, 4, 0) == kernels.INVALID_ARGUMENT
    assert bn(0, None, None, None, None, 0, 3, 4, 0) == kernels.OK  # empty: nothing to do
    mm = lib.dk_matmul_relu_cpu
    assert mm(0, p, p, None, None, 2, 2, 2) == kernels.INVALID_ARGUMENT
    assert mm(0, p, p, None, p, 2, -1, 2) == kernels.INVALID_ARGUMENT
    assert mm(0, None, None, None, None, 0, 5, 7) == kernels.OK
    with pytest.raises(kernels.KernelError, match="invalid argument"):
        kernels.check(kernels.INVALID_ARGUMENT, "dk_test", lib)
    with pytest.raises(TypeError):
        kernels.matmul_relu_cpu(np.ones((2, 2), np.float64), np.ones((2, 2)), lib=lib)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.matmul_relu_cpu(np.ones((4, 4), np.float32)[:, :2], np.ones((2, 2), np.float32),
                                lib=lib)
    for status in range(5):
        assert lib.dk_status_string(status)
    assert lib.dk_status_string(99) == b"unknown deploykit status"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_cuda_entry_points_fail_cleanly_without_gpu(lib):
    x = np.ones((1, 2, 8), np.float32)
    s = np.ones(2, np.float32)
    status = lib.dk_fused_batch_norm_cuda(0, x.ctypes.data, s.ctypes.data, s.ctypes.data,
                                          x.ctypes.data, 1, 2, 8, 0, None)
    assert status in (kernels.CUDA_ERROR, kernels.NOT_COMPILED)
    status = lib.dk_matmul_relu_cuda(0, x.ctypes.data, x.ctypes.data, None, x.ctypes.data,
                                     1, 1, 1, 0, None, 0, None)
    assert status in (kernels.CUDA_ERROR, kernels.NOT_COMPILED)
    assert lib.dk_matmul_relu_cuda_last_path() == -1
    # argument errors are reported before anything touches CUDA
    assert lib.dk_fused_batch_norm_cuda(7, None, None, None, None, 1, 1, 1, 0, None) in (
        kernels.INVALID_ARGUMENT, kernels.NOT_COMPILED)
