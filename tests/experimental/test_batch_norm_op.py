"""deploykit.experimental.training_batch_norm without a GPU: the CUDA source builds into the kernel library with
the BatchNorm training entry points exported, the C ABI rejects bad arguments before touching a
device, and the Python op checks its arguments and refuses CPU tensors with a clear message.
The GPU behaviour is tested in tests/gpu/test_batch_norm_cuda.py."""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch

from deploykit.native import kernels
from deploykit.experimental import training_batch_norm as bn

F = torch.nn.functional


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    if shutil.which("cmake") is None:
        pytest.skip("cmake not found: cannot build the kernel library")
    path = kernels.build_library(tmp_path_factory.mktemp("bn-kernels"), cuda_architectures="90")
    library = kernels.load(path)
    probe = library.dk_fused_batch_norm_cuda(0, None, None, None, None, 0, 0, 0, 0, None)
    if probe == kernels.NOT_COMPILED:
        pytest.skip("nvcc not found: the library was built without CUDA (no BatchNorm training "
                    "kernels)")
    return bn.declare(library)


def test_library_exports_batch_norm_training_symbols(lib):
    for name in bn.SYMBOLS:
        assert hasattr(lib, name), name


def test_c_abi_rejects_bad_arguments_without_a_device(lib):
    # Checked before any CUDA call: an unknown dtype and negative or overflowing sizes.
    for dtype in (4, -1, 99):
        assert lib.dk_batch_norm_train_forward_cuda(
            dtype, None, None, None, None, None, 0.1, 1e-5, None, None, None, None, 0, 2, 3, 4,
            None) == kernels.INVALID_ARGUMENT
        assert lib.dk_batch_norm_backward_cuda(
            dtype, None, None, None, None, None, None, None, None, None, 0, 2, 3, 4, 1,
            None) == kernels.INVALID_ARGUMENT
        assert lib.dk_batch_norm_eval_forward_cuda(
            dtype, None, None, None, None, None, 1e-5, None, 1, None, 0, 2, 3, 4,
            None) == kernels.INVALID_ARGUMENT
        assert lib.dk_batch_norm_workspace_bytes(dtype, 2, 3, 4) == 0
    for sizes in ((-1, 3, 4), (2, -3, 4), (1 << 40, 1 << 40, 2)):
        assert lib.dk_batch_norm_train_forward_cuda(
            0, None, None, None, None, None, 0.1, 1e-5, None, None, None, None, 0, *sizes,
            None) == kernels.INVALID_ARGUMENT
        assert lib.dk_batch_norm_workspace_bytes(0, *sizes) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-device answer")
def test_c_abi_without_a_device_reports_cuda_error(lib):
    assert lib.dk_batch_norm_workspace_bytes(0, 2, 3, 4) == 0
    status = lib.dk_batch_norm_train_forward_cuda(
        0, None, None, None, None, None, 0.1, 1e-5, None, None, None, None, 0, 2, 3, 4, None)
    assert status == kernels.CUDA_ERROR


def test_float64_dtype_code_is_new_enumerator():
    assert bn.DTYPE_CODES[torch.float64] == 3
    assert [bn.DTYPE_CODES[t] for t in (torch.float32, torch.float16, torch.bfloat16)] == [
        kernels.FLOAT32, kernels.FLOAT16, kernels.BFLOAT16]


# ------------------------------------------------------------------------- Python op checks


def test_cpu_tensor_is_refused_with_a_clear_error():
    x = torch.randn(4, 3, 5, 5)
    with pytest.raises(RuntimeError, match="CUDA tensors only.*input is on cpu"):
        bn.batch_norm(x, torch.zeros(3), torch.ones(3), training=True)
    with pytest.raises(RuntimeError, match="CUDA tensors only"):
        bn.batch_norm(x, torch.zeros(3), torch.ones(3), training=False)


@pytest.mark.parametrize("call, error, message", [
    (lambda x: bn.batch_norm(x.int(), None, None, training=True), TypeError, "dtype torch.int32"),
    (lambda x: bn.batch_norm(x[0, 0, 0], None, None, training=True), ValueError, r"shape \(N, C"),
    (lambda x: bn.batch_norm(x, torch.zeros(4), torch.ones(4)), ValueError,
     r"running_mean has shape \(4,\), expected \(3,\)"),
    (lambda x: bn.batch_norm(x, None, None, torch.ones(2), training=True), ValueError,
     r"weight has shape"),
    (lambda x: bn.batch_norm(x, None, None, None, torch.ones(3, 1), training=True), ValueError,
     r"bias has shape"),
    (lambda x: bn.batch_norm(x, torch.zeros(3), None, training=True), ValueError, "both"),
    (lambda x: bn.batch_norm(x, None, None, training=False), ValueError,
     "needed when training=False"),
    (lambda x: bn.batch_norm(x[:1, :, :1, :1], None, None, training=True), ValueError,
     "more than 1 value per channel"),
    (lambda x: bn.batch_norm(x, None, None, training=True, eps=-1.0), ValueError, "eps"),
    (lambda x: bn.batch_norm(x, None, None, training=True, momentum=float("nan")), ValueError,
     "momentum"),
    (lambda x: bn.batch_norm(x, None, None, torch.ones(3, dtype=torch.int64), training=True),
     TypeError, "floating-point"),
])
def test_argument_checks(call, error, message):
    with pytest.raises(error, match=message):
        call(torch.randn(4, 3, 5, 5))


def test_missing_library_file_is_reported(monkeypatch, tmp_path):
    monkeypatch.setattr(bn, "_lib", None)
    monkeypatch.setenv(kernels.ENV_VAR, str(tmp_path / "missing.so"))
    with pytest.raises(FileNotFoundError, match="missing.so"):
        bn.library()


def test_library_without_the_symbols_is_reported():
    class Bare:  # a loaded library that predates the BatchNorm training kernels
        pass

    with pytest.raises(RuntimeError, match="lacks dk_batch_norm_workspace_bytes"):
        bn.declare(Bare())


# ------------------------------------------------------------------------------ module


def test_module_falls_back_to_torch_on_cpu():
    torch.manual_seed(0)
    ref = torch.nn.BatchNorm2d(5, momentum=None)
    ours = bn.BatchNorm2d(5, momentum=None)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(6, 5, 4, 7)
    for _ in range(2):
        torch.testing.assert_close(ours(x), ref(x))
    torch.testing.assert_close(ours.state_dict(), ref.state_dict())
    ours.eval(), ref.eval()
    torch.testing.assert_close(ours(x), ref(x))


def test_replace_batch_norm_shares_parameters_and_buffers():
    inner = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4, affine=False))
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 1), torch.nn.BatchNorm2d(3, eps=1e-3),
                                inner, torch.nn.BatchNorm1d(4))
    model.eval()
    old = model[1]
    weight, running_mean = old.weight, old.running_mean
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 2, 3, 3)
    before = model[:3](x)
    out = bn.replace_batch_norm(model)
    assert out is model
    assert type(model[1]) is bn.BatchNorm2d and type(model[2][1]) is bn.BatchNorm2d
    assert type(model[3]) is torch.nn.BatchNorm1d  # only BatchNorm2d is replaced
    assert model[1].weight is weight and model[1].running_mean is running_mean
    assert model[1].eps == 1e-3 and not model[1].training
    assert model[2][1].weight is None and not model[2][1].affine
    assert set(model.state_dict()) == set(state)
    assert type(bn.replace_batch_norm(torch.nn.BatchNorm2d(3))) is bn.BatchNorm2d
    torch.testing.assert_close(model[:3](x), before)  # CPU: PyTorch's implementation
