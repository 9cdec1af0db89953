"""Page-locked host buffers that a GPU runner's batches are assembled in.

A batch is its requests' rows concatenated and padded up to the bucket, then copied to the GPU.
Copied from ordinary (pageable) memory, the driver first copies it again into a page-locked
staging area of its own, in pieces, and the copy runs at a fraction of the bus's speed; from
page-locked memory it is one DMA transfer. A server assembles every batch, so each runner's worker
keeps one such buffer per input, reused across batches; only rows that held data in an earlier
batch are zeroed again when they become padding.
"""

from __future__ import annotations

import numpy as np


class PinnedStaging:
    """One runner's batch buffers in page-locked memory (torch's pinned host allocator)."""

    def __init__(self, torch):
        self.torch = torch
        self._buffers: dict[str, np.ndarray] = {}
        self._filled: dict[str, int] = {}  # rows that may hold data from an earlier batch

    @staticmethod
    def for_runner(runner) -> PinnedStaging | None:
        """Staging for a runner on a GPU, where torch can pin memory; None elsewhere (a CPU runner
        reads host memory as it is)."""
        if runner.device != "cuda":
            return None
        try:
            import torch
        except ImportError:
            return None
        return PinnedStaging(torch) if torch.cuda.is_available() else None

    def assemble(self, name: str, parts: list[np.ndarray], rows: int, size: int) -> np.ndarray:
        """``parts`` (``rows`` rows together) concatenated, zero rows up to ``size``, in this input's buffer."""
        first = parts[0]
        buffer = self._buffer(name, size, first.shape[1:], first.dtype)
        batch = buffer[:size]
        np.concatenate(parts, out=batch[:rows])
        filled = self._filled[name]
        if filled > rows:
            batch[rows:min(filled, size)] = 0
        self._filled[name] = rows
        return batch

    def _buffer(self, name: str, size: int, trailing: tuple, dtype: np.dtype) -> np.ndarray:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape[0] < size or buffer.shape[1:] != trailing or buffer.dtype != dtype:
            capacity = max(size, buffer.shape[0] if buffer is not None and buffer.shape[1:] == trailing else 0)
            nbytes = capacity * int(np.prod(trailing, dtype=np.int64)) * dtype.itemsize
            pinned = self.torch.zeros(max(nbytes, 1), dtype=self.torch.uint8, pin_memory=True)
            buffer = pinned.numpy()[:nbytes].view(dtype).reshape(capacity, *trailing)
            self._buffers[name], self._filled[name] = buffer, 0
        return buffer
