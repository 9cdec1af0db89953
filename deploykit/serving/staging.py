"""Batches assembled from their requests' rows: in page-locked host buffers for a GPU runner.

A batch is its requests' rows concatenated and padded up to the bucket, then copied to the GPU.
Copied from ordinary (pageable) memory, the driver first copies it again into a page-locked
staging area of its own, in pieces, and the copy runs at a fraction of the bus's speed; from
page-locked memory it is one DMA transfer. A server assembles every batch, so each runner's worker
keeps one such buffer per input, reused across batches; only rows that held data in an earlier
batch are zeroed again when they become padding.

Rows are copied into a batch with the GIL held (``copy_rows``). numpy lets go of the GIL for each
copy of more than a few hundred elements and takes it back after; a batch of 32 requests is 32
copies, and while another thread runs Python (the event loop parsing the next requests, the model
process reading its pipes) each taking-back can wait out that thread's switch interval (5 ms).
Measured on two cores beside a thread running Python: 32 rows of 3x224x224 fp32 took 165 ms with
``np.concatenate``, 1.0 ms copied with the GIL held (0.8 and 1.0 ms with no other thread).

The model process of ``serve --workers`` goes further (``DeviceStaging``): its requests arrive in
shared-memory buffers that ``HostRegistry`` page-locks in place once each, so their rows can go by
DMA straight into a batch tensor on the GPU, with no copy on the host at all. On a GPU host that
copy was a third of the time the model process held the GIL (600 KB per image, held on purpose, as
above). The copies are queued in one ``torch._foreach_copy_`` call, which lets go of the GIL once
for the whole batch: a ``copy_`` per request (tried on 2026-12-03) gave it up and waited for it
again 32 times a batch, and served fewer requests than the host copy. Small rows (a few KB of token
ids) are gathered on the host, where copying them costs less than a transfer each, and go to the
GPU as one batch.

Answers take the same road back. A runner fed GPU tensors answers with GPU tensors, and only the
rows that hold data come back (a batch of 5 requests padded to 32 copies 5 rows, not 32). Where
each request's rows are large (a BERT request's hidden states are 393 KB) they go by DMA straight
into the request's own page-locked buffer, which its worker reads the answer from: no pageable
copy, no second copy on the host.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import mmap

import numpy as np

from deploykit.backends.base.feeds import numpy_dtype_of_torch
from deploykit.backends.base.memory import torch_from_host, torch_to_host

log = logging.getLogger("deploykit.serve")
#: Alignment of each tensor in a request buffer: our kernels refuse misaligned pointers.
ALIGN = 64


def _memmove_holding_gil():
    """libc's memmove called through ``ctypes.PyDLL``, which keeps the GIL; None where the process
    has no C library to find it in."""
    try:
        memmove = ctypes.PyDLL(None).memmove
    except (OSError, AttributeError, TypeError):
        return None
    memmove.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    memmove.restype = None
    return memmove


_MEMMOVE = _memmove_holding_gil()
#: numpy keeps the GIL for copies of up to this many elements (NPY_BEGIN_THREADS_THRESHOLDED).
NUMPY_KEEPS_GIL = 500
#: Rows smaller than this on average (bytes per request) are batched on the host, not copied by DMA.
DMA_MIN_BYTES = 64 << 10


def copy_rows(parts: list[np.ndarray], out: np.ndarray) -> None:
    """``parts`` one after the other along dimension 0 into ``out`` (exactly their rows), without
    letting go of the GIL between parts; parts numpy copies under the GIL anyway, or that are not
    laid out as ``out`` is, are copied by numpy. ValueError where the parts do not fit ``out``."""
    trailing = out.shape[1:]
    if any(part.shape[1:] != trailing for part in parts) or sum(part.shape[0] for part in parts) != out.shape[0]:
        raise ValueError(f"rows of shapes {[part.shape for part in parts]} do not make a batch of {out.shape}")
    direct = _MEMMOVE is not None and out.flags.c_contiguous
    address, start = (out.ctypes.data if direct else 0), 0
    for part in parts:
        stop = start + part.shape[0]
        if direct and part.size > NUMPY_KEEPS_GIL and part.flags.c_contiguous and part.dtype == out.dtype:
            _MEMMOVE(address + start * out.strides[0], part.ctypes.data, part.nbytes)
        else:
            np.copyto(out[start:stop], part)
        start = stop


def buffer_layout(tensors) -> tuple[list[tuple], int]:
    """Where each of ``tensors`` (``(name, numpy dtype, shape)``) lies in a request buffer, one after
    the other on ``ALIGN``-byte boundaries: ``[(name, dtype, shape, offset)]``, and the bytes they take."""
    layout, end = [], 0
    for name, dtype, shape in tensors:
        layout.append((name, dtype, tuple(shape), end))
        end += -(-int(np.prod(shape, dtype=np.int64)) * dtype.itemsize // ALIGN) * ALIGN
    return layout, end


def buffer_address(memory: mmap.mmap) -> int:
    """Where a mapped buffer starts in this process's memory."""
    return np.frombuffer(memory, np.uint8).ctypes.data


def buffer_views(memory: mmap.mmap, layout: list[tuple]) -> dict[str, np.ndarray]:
    """The arrays ``layout`` places in ``memory`` (views, not copies)."""
    return {name: np.ndarray(shape, dtype, buffer=memory, offset=offset) for name, dtype, shape, offset in layout}


def split_rows(outputs: dict, rows: list[int]) -> list[dict]:
    """Each request's rows of a batch's outputs (``rows``: each request's count, in order; rows
    beyond them are padding and dropped)."""
    have, wanted = {name: np.shape(value)[0] for name, value in outputs.items()}, sum(rows)
    if any(n < wanted for n in have.values()):
        raise RuntimeError(f"outputs have {have} rows for {wanted} input rows: serve with --max-batch 1")
    results, start = [], 0
    for count in rows:
        results.append({name: value[start:start + count] for name, value in outputs.items()})
        start += count
    return results


def host_answers(outputs: dict, rows: list[int]) -> list[dict]:
    """Each request's rows of a run's outputs, as numpy. Outputs on the GPU come back in one copy of
    the rows that hold data; the copy waits for the run, after which the buffers the batch was read
    from may be reused."""
    wanted = sum(rows)
    return split_rows({name: value if isinstance(value, np.ndarray) else torch_to_host(value[:wanted])
                       for name, value in outputs.items()}, rows)


class PinnedStaging:
    """One runner's batches: assembled in page-locked host buffers (torch's pinned host allocator),
    one per input, then copied to the runner's GPU whole, so that the runner answers with GPU
    tensors, of which only the rows that hold data come back (``host_answers``)."""

    def __init__(self, torch, device):
        self.torch, self.device = torch, device
        self._buffers: dict[str, np.ndarray] = {}
        self._filled: dict[str, int] = {}  # rows that may hold data from an earlier batch
        self._on_device: dict[str, _OnDevice] = {}

    @staticmethod
    def for_runner(runner, gpu: int | None = None) -> PinnedStaging | None:
        """Staging for a runner on GPU ``gpu``, where torch can pin memory; None elsewhere (a CPU runner
        reads host memory as it is)."""
        torch = _cuda_torch(runner)
        return PinnedStaging(torch, torch.device("cuda", gpu or 0)) if torch is not None else None

    def feeds(self, names: list[str], requests: list[dict[str, np.ndarray]], rows: int, size: int) -> dict:
        """One batch per input on the GPU: the requests' arrays of that name, zero rows up to ``size``."""
        return {name: self._to_device(name, self.assemble(name, [inputs[name] for inputs in requests], rows, size), rows)
                for name in names}

    def answers(self, outputs: dict, requests: list[dict[str, np.ndarray]], rows: list[int]) -> list[dict]:
        """Each request's rows of a run's outputs, as numpy (``host_answers``)."""
        return host_answers(outputs, rows)

    def drain(self) -> None:
        """After a failed run: wait for the copies still reading host buffers, which the next batch
        overwrites (a lost GPU context fails this too: nothing then reads)."""
        with contextlib.suppress(RuntimeError):
            self.torch.cuda.current_stream(self.device).synchronize()

    def assemble(self, name: str, parts: list[np.ndarray], rows: int, size: int) -> np.ndarray:
        """``parts`` (``rows`` rows together) concatenated, zero rows up to ``size``, in this input's buffer."""
        first = parts[0]
        buffer = self._buffer(name, size, first.shape[1:], first.dtype)
        batch = buffer[:size]
        copy_rows(parts, batch[:rows])
        filled = self._filled[name]
        if filled > rows:
            batch[rows:min(filled, size)] = 0
        self._filled[name] = _still_filled(filled, rows, size)
        return batch

    def _buffer(self, name: str, size: int, trailing: tuple, dtype: np.dtype) -> np.ndarray:
        buffer = self._buffers.get(name)
        if (capacity := _rows_to_allocate(buffer, size, trailing, dtype)) is not None:
            nbytes = capacity * int(np.prod(trailing, dtype=np.int64)) * dtype.itemsize
            pinned = self.torch.zeros(max(nbytes, 1), dtype=self.torch.uint8, pin_memory=True)
            buffer = pinned.numpy()[:nbytes].view(dtype).reshape(capacity, *trailing)
            self._buffers[name], self._filled[name] = buffer, 0
        return buffer

    def _to_device(self, name: str, batch: np.ndarray, rows: int):
        """A batch assembled on the host (in page-locked memory, reused only once this batch's answers
        are back: the copy has ended by then) as this input's batch tensor on the GPU."""
        source = torch_from_host(batch)
        size = batch.shape[0]
        staged = self._staged(name, size, source)
        target = staged.batch[:size]
        target.copy_(source, non_blocking=True)
        staged.filled = _still_filled(staged.filled, rows, size)
        return target

    def _staged(self, name: str, size: int, first) -> _OnDevice:
        staged = self._on_device.get(name)
        batch = None if staged is None else staged.batch
        if (capacity := _rows_to_allocate(batch, size, tuple(first.shape[1:]), first.dtype)) is not None:
            zeros = self.torch.zeros((capacity, *first.shape[1:]), dtype=first.dtype, device=self.device)
            staged = self._on_device[name] = _OnDevice(zeros.clone(), zeros)
        return staged


@dataclasses.dataclass
class _OnDevice:
    batch: object  # the input's batch tensor on the GPU, at the largest size asked for so far
    zeros: object  # as many zero rows, the source of padding rows that held data
    filled: int = 0  # rows of ``batch`` that may hold data from an earlier batch


class DeviceStaging(PinnedStaging):
    """One runner's batches on its GPU, each request's rows copied there by DMA from shared memory
    that ``registry`` page-locked, and the rows of large answers copied back the same way
    (``answers``); batches with other rows (requests that came through the pipe, a buffer the driver
    refused to lock, small rows) are assembled on the host as ``PinnedStaging`` does."""

    def __init__(self, torch, device, registry: HostRegistry):
        super().__init__(torch, device)
        self.registry = registry

    @staticmethod
    def for_runner(runner, gpu: int | None = None, *, registry: HostRegistry | None = None) -> PinnedStaging | None:
        torch = _cuda_torch(runner)
        if torch is None or registry is None:
            return PinnedStaging.for_runner(runner, gpu)
        return DeviceStaging(torch, torch.device("cuda", gpu or 0), registry)

    def feeds(self, names: list[str], requests: list[dict[str, np.ndarray]], rows: int, size: int) -> dict:
        parts = {name: [inputs[name] for inputs in requests] for name in names}
        every = [part for group in parts.values() for part in group]
        small = sum(part.nbytes for part in every) < DMA_MIN_BYTES * len(requests)
        if small or not all(map(self.registry.holds, every)):
            return super().feeds(names, requests, rows, size)
        targets, sources, feeds = [], [], {}
        for name, group in parts.items():
            group = [torch_from_host(part) for part in group]
            staged = self._staged(name, size, group[0])
            batch, start = staged.batch[:size], 0
            for source in group:
                targets.append(batch[start:start + source.shape[0]])
                start += source.shape[0]
            sources += group
            stale = min(staged.filled, size) - rows
            if stale > 0:
                targets.append(batch[rows:rows + stale])
                sources.append(staged.zeros[:stale])
            staged.filled = _still_filled(staged.filled, rows, size)
            feeds[name] = batch
        self.torch._foreach_copy_(targets, sources, non_blocking=True)  # the GIL let go of once
        return feeds

    def answers(self, outputs: dict, requests: list[dict[str, np.ndarray]], rows: list[int]) -> list[dict]:
        """Each request's rows of the outputs. Where they are large (``DMA_MIN_BYTES`` a request) and
        every request came in a page-locked buffer with room for them, each request's rows go by DMA
        straight into its own buffer, from its start (``buffer_layout``; its inputs are spent once the
        run read them), where the model process answers from without copying them again
        (``model_host``); else as ``PinnedStaging`` brings them back."""
        placed = self._in_request_buffers(outputs, requests, rows)
        if placed is None:
            return super().answers(outputs, requests, rows)
        answers, targets, sources = placed
        self.torch._foreach_copy_(targets, sources, non_blocking=True)  # the GIL let go of once
        self.torch.cuda.current_stream(self.device).synchronize()
        return answers

    def _in_request_buffers(self, outputs: dict, requests: list[dict[str, np.ndarray]], rows: list[int]):
        """Each request's answer as views of its buffer, and the copies (targets, sources) that fill
        them; None where the outputs are not large GPU tensors or a request has no buffer to take them."""
        wanted = sum(rows)
        if any(isinstance(value, np.ndarray) or value.shape[0] < wanted for value in outputs.values()):
            return None
        row_bytes = sum(value[0].numel() * value.element_size() for value in outputs.values())
        if row_bytes * wanted < DMA_MIN_BYTES * len(requests):
            return None
        specs = [(name, numpy_dtype_of_torch(value.dtype), tuple(value.shape[1:]))
                 for name, value in outputs.items()]
        answers, targets, sources, start, taken = [], [], [], 0, set()
        for request, count in zip(requests, rows):
            memory = self.registry.buffer_of(next(iter(request.values())))
            layout, end = buffer_layout((name, dtype, (count, *shape)) for name, dtype, shape in specs)
            if memory is None or end > len(memory) or id(memory) in taken:  # one buffer, one answer
                return None
            taken.add(id(memory))
            answer = buffer_views(memory, layout)
            targets += [torch_from_host(view) for view in answer.values()]
            sources += [value[start:start + count] for value in outputs.values()]
            answers.append(answer)
            start += count
        return answers, targets, sources


class HostRegistry:
    """Shared-memory request buffers page-locked in place (``cudaHostRegister``), once per buffer:
    a worker reuses its buffers request after request, so their rows go to the GPU by DMA. A buffer
    is taken out (``remove``) before it is unmapped. Where the driver refuses (a buffer on a disk
    rather than the RAM disk, a locked-memory limit) it is said once, and rows go through the host."""

    def __init__(self, torch, gpu: int):
        self.torch, self.gpu = torch, gpu
        self._registered: dict[int, int] = {}  # id(mmap) -> its address
        self._refused = False

    @staticmethod
    def for_models(models) -> HostRegistry | None:
        """A registry where a model runs on a GPU that torch reaches; None elsewhere."""
        for model in models:
            if model.gpus and _cuda_torch(model.runner) is not None:
                import torch

                return HostRegistry(torch, model.gpus[0])
        return None

    def __len__(self) -> int:
        """How many buffers are page-locked now."""
        return len(self._registered)

    def holds(self, array: np.ndarray) -> bool:
        """Whether ``array`` views a page-locked buffer."""
        return self.buffer_of(array) is not None

    def buffer_of(self, array: np.ndarray) -> mmap.mmap | None:
        """The page-locked buffer ``array`` views, if any."""
        base = array
        while isinstance(base, np.ndarray):
            base = base.base
        return base if id(base) in self._registered else None

    def add(self, memory: mmap.mmap) -> None:
        if self._refused or id(memory) in self._registered:
            return
        address = buffer_address(memory)
        with self.torch.cuda.device(self.gpu):
            status = int(self.torch.cuda.cudart().cudaHostRegister(address, len(memory), 1))  # 1: portable
        if status != 0:
            self._refused = True
            log.warning("cudaHostRegister of a request buffer failed (CUDA error %d): batches are assembled on the "
                        "host, which holds the model process's GIL longer", status)
            return
        self._registered[id(memory)] = address

    def remove(self, memory: mmap.mmap) -> None:
        address = self._registered.pop(id(memory), None)
        if address is not None:
            with self.torch.cuda.device(self.gpu):
                self.torch.cuda.cudart().cudaHostUnregister(address)


def _still_filled(filled: int, rows: int, size: int) -> int:
    """The rows of a buffer that may hold data after a batch of ``size`` rows (``rows`` of them data,
    the rest zeroed) where ``filled`` rows may have before: rows beyond the batch keep theirs."""
    return filled if filled > size else rows


def _rows_to_allocate(buffer, size: int, trailing: tuple, dtype) -> int | None:
    """None where ``buffer`` (numpy or torch, or None) holds a batch of ``size`` rows of ``trailing`` shape and
    ``dtype``; else the rows of the buffer to make: ``size``, or as many as a buffer of the same rows had."""
    same_rows = buffer is not None and tuple(buffer.shape[1:]) == tuple(trailing)
    if same_rows and buffer.shape[0] >= size and buffer.dtype == dtype:
        return None
    return max(size, buffer.shape[0] if same_rows else 0)


def _cuda_torch(runner):
    """torch, where ``runner`` runs on a GPU that torch can reach; else None."""
    if runner.device != "cuda":
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None
