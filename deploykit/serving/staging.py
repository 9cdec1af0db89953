"""Where a GPU runner's batches are assembled: its requests' rows concatenated and padded up to
the bucket, then on the GPU.

Copied from ordinary (pageable) memory, the driver first copies a batch again into a page-locked
staging area of its own, in pieces, and the copy runs at a fraction of the bus's speed; from
page-locked memory it is one DMA transfer. Two ways to get there:

- ``PinnedStaging`` (one-process ``serve``, Triton's python model): the rows are concatenated into
  a page-locked host buffer, which the runner copies to the GPU in one transfer.
- ``DeviceStaging`` (the model process of ``serve --workers``): the requests arrive in shared-memory
  buffers that ``HostRegistry`` page-locked in place once, so each request's rows go by DMA straight
  into a batch tensor on the GPU. The CPU copies nothing and holds the GIL for none of it: at 32
  images of 600 KB a batch, the host-side concatenation was 40 % of the model process's time.

Each runner's worker keeps one buffer per input, reused across batches; only rows that held data
in an earlier batch are zeroed again when they become padding.
"""

from __future__ import annotations

import logging
import mmap

import numpy as np

from deploykit.backends.base.memory import torch_from_host, torch_to_host

log = logging.getLogger("deploykit.serve")


class Staging:
    """One buffer per input, grown as batches need, that a batch's rows are placed in."""

    def __init__(self, torch):
        self.torch = torch
        self._buffers: dict = {}
        self._filled: dict[str, int] = {}  # rows that may hold data from an earlier batch

    def assemble(self, name: str, parts: list[np.ndarray], rows: int, size: int):
        """``parts`` (``rows`` rows together) concatenated, zero rows up to ``size``, in this input's buffer."""
        first = parts[0]
        batch = self._buffer(name, size, first)[:size]
        self._place(batch[:rows], parts)
        filled = self._filled[name]
        if filled > rows:
            batch[rows:min(filled, size)] = 0
        self._filled[name] = rows
        return batch

    def outputs(self, outputs: dict) -> dict:
        """A run's outputs as the batcher splits them (numpy)."""
        return outputs

    def _buffer(self, name: str, size: int, first: np.ndarray):
        buffer = self._buffers.get(name)
        trailing = tuple(first.shape[1:])
        if buffer is None or buffer.shape[0] < size or tuple(buffer.shape[1:]) != trailing or not self._holds(buffer, first):
            same_rows = buffer is not None and tuple(buffer.shape[1:]) == trailing
            capacity = max(size, buffer.shape[0] if same_rows else 0)
            buffer = self._buffers[name] = self._allocate(capacity, first)
            self._filled[name] = 0
        return buffer

    def _allocate(self, capacity: int, first: np.ndarray):
        raise NotImplementedError

    def _holds(self, buffer, first: np.ndarray) -> bool:
        raise NotImplementedError

    def _place(self, rows, parts: list[np.ndarray]) -> None:
        raise NotImplementedError


class PinnedStaging(Staging):
    """One runner's batch buffers in page-locked host memory (torch's pinned host allocator)."""

    @staticmethod
    def for_runner(runner) -> PinnedStaging | None:
        """Staging for a runner on a GPU, where torch can pin memory; None elsewhere (a CPU runner
        reads host memory as it is)."""
        torch = _cuda_torch(runner)
        return PinnedStaging(torch) if torch is not None else None

    def _allocate(self, capacity: int, first: np.ndarray) -> np.ndarray:
        nbytes = capacity * int(np.prod(first.shape[1:], dtype=np.int64)) * first.dtype.itemsize
        pinned = self.torch.zeros(max(nbytes, 1), dtype=self.torch.uint8, pin_memory=True)
        return pinned.numpy()[:nbytes].view(first.dtype).reshape(capacity, *first.shape[1:])

    def _holds(self, buffer: np.ndarray, first: np.ndarray) -> bool:
        return buffer.dtype == first.dtype

    def _place(self, rows: np.ndarray, parts: list[np.ndarray]) -> None:
        np.concatenate(parts, out=rows)


class DeviceStaging(Staging):
    """One runner's batch tensors on its GPU, each request's rows copied in by DMA where its memory
    is page-locked (``HostRegistry``); other rows (requests that came through the pipe) are copied
    as pageable memory is, correctly but slower."""

    def __init__(self, torch, device):
        super().__init__(torch)
        self.device = device

    @staticmethod
    def for_runner(runner) -> DeviceStaging | None:
        torch = _cuda_torch(runner)
        if torch is None:
            return None
        return DeviceStaging(torch, torch.device("cuda", runner.device_id))

    def outputs(self, outputs: dict) -> dict:
        """The run's outputs (torch tensors on the GPU, as its inputs were) copied to the host; this
        waits for the run, so the request buffers the rows were copied from are free after it."""
        return {name: torch_to_host(value) if hasattr(value, "device") else np.asarray(value)
                for name, value in outputs.items()}

    def _allocate(self, capacity: int, first: np.ndarray):
        dtype = torch_from_host(first[:0]).dtype
        return self.torch.zeros((capacity, *first.shape[1:]), dtype=dtype, device=self.device)

    def _holds(self, buffer, first: np.ndarray) -> bool:
        return buffer.dtype == torch_from_host(first[:0]).dtype

    def _place(self, rows, parts: list[np.ndarray]) -> None:
        start = 0
        for part in parts:
            rows[start:start + len(part)].copy_(torch_from_host(part), non_blocking=True)
            start += len(part)


class HostRegistry:
    """Shared-memory request buffers page-locked in place (``cudaHostRegister``), once per buffer:
    the buffers are reused request after request, so a batch's rows go to the GPU by DMA. A buffer
    must be taken out (``remove``) before it is unmapped. Registration that fails (a driver that
    refuses, locked-memory limits) is said once and left out: those rows are copied as pageable."""

    def __init__(self, torch, device):
        self.torch, self.device = torch, device
        self._registered: dict[int, int] = {}  # id(mmap) -> its address
        self._refused = False

    @staticmethod
    def for_runners(runners) -> HostRegistry | None:
        """A registry for the first GPU runner's device, or None where no runner is on a GPU."""
        for runner in runners:
            if (torch := _cuda_torch(runner)) is not None:
                return HostRegistry(torch, torch.device("cuda", runner.device_id))
        return None

    def __len__(self) -> int:
        """How many buffers are page-locked now."""
        return len(self._registered)

    def add(self, memory: mmap.mmap) -> None:
        if self._refused or id(memory) in self._registered:
            return
        address = np.frombuffer(memory, np.uint8).ctypes.data
        with self.torch.cuda.device(self.device):
            status = int(self.torch.cuda.cudart().cudaHostRegister(address, len(memory), 1))  # 1: portable
        if status != 0:
            self._refused = True
            log.warning("cudaHostRegister of a request buffer failed (CUDA error %d): request rows are copied to "
                        "the GPU from pageable memory, which is slower", status)
            return
        self._registered[id(memory)] = address

    def remove(self, memory: mmap.mmap) -> None:
        address = self._registered.pop(id(memory), None)
        if address is not None:
            with self.torch.cuda.device(self.device):
                self.torch.cuda.cudart().cudaHostUnregister(address)


def _cuda_torch(runner):
    """torch, where ``runner`` runs on a GPU that torch can reach; else None."""
    if runner.device != "cuda":
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None
