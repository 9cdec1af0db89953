"""Assembling a batch from its requests' rows: exactly ``np.concatenate``'s result, without letting
another thread take the GIL between rows (which under load makes the batch wait on every row)."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

from deploykit.serving.staging import copy_rows


def images(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, 3, 64, 64)).astype(np.float32)


def test_rows_land_in_order_whatever_their_layout():
    strided = images(4, 3)[::2]  # not contiguous: numpy copies it
    parts = [images(1, 0), images(3, 1), np.float64(1.5) * images(2, 2).astype(np.float64), strided,
             np.ones((1, 3, 64, 64), np.float32)[:, :, :, :]]
    out = np.full((sum(p.shape[0] for p in parts), 3, 64, 64), np.nan, np.float32)
    copy_rows(parts, out)
    np.testing.assert_array_equal(out, np.concatenate(parts).astype(np.float32))


def test_small_rows_and_integers():
    parts = [np.arange(128 * k, dtype=np.int64).reshape(k, 128) for k in (1, 2, 1)]
    out = np.empty((4, 128), np.int64)
    copy_rows(parts, out)
    np.testing.assert_array_equal(out, np.concatenate(parts))


@pytest.mark.parametrize("parts, shape", [
    ([np.zeros((1, 1), np.float32)], (1, 4)),  # would broadcast
    ([np.zeros((2, 4), np.float32)], (3, 4)),  # too few rows
])
def test_rows_that_do_not_fit_are_refused(parts, shape):
    with pytest.raises(ValueError, match="do not make a batch"):
        copy_rows(parts, np.empty(shape, np.float32))


def test_host_batches_pad_with_zeros_where_an_earlier_larger_batch_left_rows():
    from deploykit.serving.staging import PinnedStaging

    staging = PinnedStaging(CpuTorch(), None)  # assembling only: no device needed
    full = staging.assemble("x", [images(5, 0)], 5, 8)
    staging.assemble("x", [images(1, 1)], 1, 2)  # rows 2-4 keep the first batch's data
    again = staging.assemble("x", [images(2, 2)], 2, 8)
    assert again.ctypes.data == full.ctypes.data
    np.testing.assert_array_equal(again, np.concatenate([images(2, 2), np.zeros((6, 3, 64, 64), np.float32)]))


def counted_while(copy) -> int:
    """How often a thread that lets go of the GIL at every step ran while ``copy()`` ran; with a long
    switch interval it runs only when the copying thread lets go of the GIL itself."""
    steps, stop = [0], threading.Event()

    def step():
        while not stop.is_set():
            steps[0] += 1
            time.sleep(0)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    thread = threading.Thread(target=step)
    thread.start()
    try:
        time.sleep(0.01)
        before = steps[0]
        copy()
        during = steps[0] - before
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    return during


def test_copying_keeps_the_gil_where_numpy_lets_it_go():
    parts = [np.random.default_rng(i).standard_normal((1, 3, 224, 224)).astype(np.float32) for i in range(32)]
    out = np.empty((32, 3, 224, 224), np.float32)
    assert counted_while(lambda: copy_rows(parts, out)) == 0  # np.concatenate lets it go 32 times
    np.testing.assert_array_equal(out, np.concatenate(parts))


# Batches assembled on the GPU (``DeviceStaging``): its bookkeeping, checked here on the CPU ----------


class Registered:
    """A HostRegistry that holds the memory of the arrays and the mapped buffers it is given (nothing
    is page-locked here)."""

    def __init__(self, *arrays: np.ndarray, buffers=()):
        self.arrays, self.buffers = arrays, buffers

    def holds(self, array: np.ndarray) -> bool:
        return any(np.may_share_memory(array, held) for held in self.arrays) or self.buffer_of(array) is not None

    def buffer_of(self, array: np.ndarray):
        base = array
        while isinstance(base, np.ndarray):
            base = base.base
        return next((buffer for buffer in self.buffers if buffer is base), None)


class CpuTorch:
    """torch with the CPU for a GPU: page-locking asked for is left out, and waiting for the GPU's
    stream is nothing (there is no driver here)."""

    def __init__(self):
        from types import SimpleNamespace

        self.torch = pytest.importorskip("torch")
        self.cuda = SimpleNamespace(current_stream=lambda _device: SimpleNamespace(synchronize=lambda: None))

    def __getattr__(self, name):
        return getattr(self.torch, name)

    def zeros(self, *shape, pin_memory=False, **options):
        return self.torch.zeros(*shape, **options)


def large_images(count: int, seed: int) -> np.ndarray:
    """Images of 192 KB each: rows large enough to be worth a DMA transfer each."""
    return np.random.default_rng(seed).standard_normal((count, 3, 128, 128)).astype(np.float32)


def device_staging(registry):
    from deploykit.serving.staging import DeviceStaging

    torch = CpuTorch()
    return DeviceStaging(torch, torch.device("cpu"), registry)


def test_device_batches_pad_with_zero_rows_and_reuse_one_tensor():
    first, second = large_images(3, 0), large_images(2, 1)
    staging = device_staging(Registered(first, second, first[:1]))
    full = staging.feeds(["x"], [{"x": first}, {"x": second}], 5, 8)["x"]
    np.testing.assert_array_equal(full.numpy(), np.concatenate([first, second, np.zeros((3, 3, 128, 128), np.float32)]))
    one = staging.feeds(["x"], [{"x": first[:1]}], 1, 4)["x"]
    np.testing.assert_array_equal(one.numpy(), np.concatenate([first[:1], np.zeros((3, 3, 128, 128), np.float32)]))
    assert one.data_ptr() == full.data_ptr()  # the same tensor, the stale rows zeroed


def test_a_host_batch_goes_to_the_device_whole_and_its_answers_come_back_by_request():
    from deploykit.serving.staging import PinnedStaging

    torch = CpuTorch()
    staging = PinnedStaging(torch, torch.device("cpu"))
    first, second = images(1, 0), images(2, 1)
    batch = staging.feeds(["x"], [{"x": first}, {"x": second}], 3, 4)["x"]
    assert not isinstance(batch, np.ndarray) and "x" in staging._buffers
    np.testing.assert_array_equal(batch.numpy(), np.concatenate([first, second, np.zeros_like(first)]))
    answers = staging.answers({"y": batch.sum(dim=(1, 2, 3))}, [{"x": first}, {"x": second}], [1, 2])
    np.testing.assert_allclose(answers[1]["y"], second.sum(axis=(1, 2, 3)), rtol=1e-5)
    assert [answer["y"].shape for answer in answers] == [(1,), (2,)]


def test_page_locked_rows_of_image_size_go_by_dma_the_rest_through_the_host_into_one_device_batch():
    from deploykit.serving.staging import DMA_MIN_BYTES

    locked, pageable = large_images(4, 0), large_images(2, 1)
    tokens = np.arange(2 * 128, dtype=np.int64).reshape(2, 128)
    assert tokens.nbytes < DMA_MIN_BYTES <= locked[:1].nbytes
    staging = device_staging(Registered(locked, tokens))
    full = staging.feeds(["x"], [{"x": locked}], 4, 4)["x"]
    assert "x" not in staging._buffers  # no host buffer: by DMA
    mixed = staging.feeds(["x"], [{"x": locked[:1]}, {"x": pageable[:1]}], 2, 2)["x"]
    assert "x" in staging._buffers and mixed.data_ptr() == full.data_ptr()  # through the host, into the same tensor
    np.testing.assert_array_equal(mixed.numpy(), np.concatenate([locked[:1], pageable[:1]]))
    again = staging.feeds(["x"], [{"x": locked[:3]}], 3, 4)["x"]  # row 3 held data two batches ago
    np.testing.assert_array_equal(again.numpy(), np.concatenate([locked[:3], np.zeros_like(locked[:1])]))
    ids = staging.feeds(["ids"], [{"ids": tokens}], 2, 2)["ids"]
    assert "ids" in staging._buffers and not isinstance(ids, np.ndarray)
    np.testing.assert_array_equal(ids.numpy(), tokens)


def test_large_answers_go_into_each_requests_buffer_and_small_ones_come_back_in_one_copy():
    import mmap

    torch = pytest.importorskip("torch")
    memories = [mmap.mmap(-1, 1 << 20), mmap.mmap(-1, 1 << 20)]
    requests = [{"ids": np.ndarray((count, 8), np.int64, buffer=memory)} for memory, count in zip(memories, (1, 2))]
    staging = device_staging(Registered(buffers=memories))
    hidden = torch.arange(4 * 128 * 200, dtype=torch.float32).reshape(4, 128, 200)  # 100 KB a row; row 3 is padding
    answers = staging.answers({"hidden": hidden, "pooled": hidden[:, 0]}, requests, [1, 2])
    for answer, memory, rows in zip(answers, memories, (slice(0, 1), slice(1, 3))):
        assert answer["hidden"].ctypes.data == np.frombuffer(memory, np.uint8).ctypes.data  # at the buffer's start
        assert np.shares_memory(answer["pooled"], np.frombuffer(memory, np.uint8))
        np.testing.assert_array_equal(answer["hidden"], hidden[rows].numpy())
        np.testing.assert_array_equal(answer["pooled"], hidden[rows, 0].numpy())
    small = staging.answers({"logits": torch.arange(40.0).reshape(4, 10)}, requests, [1, 2])
    assert not any(np.shares_memory(answer["logits"], np.frombuffer(m, np.uint8)) for answer, m in zip(small, memories))
    np.testing.assert_array_equal(small[1]["logits"], np.arange(10.0, 30.0).reshape(2, 10))
    pageable = [{"ids": np.zeros((1, 8), np.int64)}, requests[1]]
    through_host = staging.answers({"hidden": hidden}, pageable, [1, 2])
    assert not np.shares_memory(through_host[1]["hidden"], np.frombuffer(memories[1], np.uint8))
    np.testing.assert_array_equal(through_host[1]["hidden"], hidden[1:3].numpy())
    with pytest.raises(RuntimeError, match="--max-batch 1"):  # fewer output rows than the batch's
        staging.answers({"hidden": hidden[:2]}, requests, [1, 2])


class FakeCudart:
    def __init__(self, status: int):
        self.status, self.registered = status, []

    def cudaHostRegister(self, address, size, flags):  # noqa: N802 - CUDA's name
        self.registered.append((address, size, flags))
        return self.status

    def cudaHostUnregister(self, address):  # noqa: N802
        self.registered = [entry for entry in self.registered if entry[0] != address]
        return 0


def fake_torch(cudart: FakeCudart):
    import contextlib
    from types import SimpleNamespace

    return SimpleNamespace(cuda=SimpleNamespace(device=lambda _gpu: contextlib.nullcontext(), cudart=lambda: cudart))


def test_registry_holds_arrays_viewing_a_registered_buffer_until_removed():
    import mmap

    from deploykit.serving.staging import HostRegistry

    cudart = FakeCudart(0)
    registry, memory = HostRegistry(fake_torch(cudart), 0), mmap.mmap(-1, 1 << 16)
    view = np.ndarray((4, 8), np.float32, buffer=memory, offset=64)
    assert not registry.holds(view)
    registry.add(memory)
    registry.add(memory)  # once per buffer
    assert len(registry) == 1 and cudart.registered == [(np.frombuffer(memory, np.uint8).ctypes.data, 1 << 16, 1)]
    assert registry.holds(view) and registry.holds(view[1:]) and not registry.holds(view.copy())
    registry.remove(memory)
    assert len(registry) == 0 and not cudart.registered and not registry.holds(view)


def test_a_refusing_driver_is_said_once_and_nothing_is_held(caplog):
    import mmap

    from deploykit.serving.staging import HostRegistry

    registry = HostRegistry(fake_torch(FakeCudart(1)), 0)
    buffers = [mmap.mmap(-1, 4096) for _ in range(3)]
    for memory in buffers:
        registry.add(memory)
    assert len(registry) == 0 and not registry.holds(np.frombuffer(buffers[0], np.uint8))
    assert [record.message for record in caplog.records].count(
        "cudaHostRegister of a request buffer failed (CUDA error 1): batches are assembled on the host, which holds "
        "the model process's GIL longer") == 1
