"""``serve --workers``' two sides in one process, over a real pipe: a worker's requests written into
shared memory reach the model process's batcher and come back exactly; buffers are reused, given
back past their budget, and replaced by the pipe where the RAM disk is full; refusals keep their
status; a model process that goes away answers every waiting request with 503. And the page-locked
staging a GPU runner's batches are assembled in.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import multiprocessing
import os
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("prometheus_client")

from deploykit.errors import BadInputError  # noqa: E402
from deploykit.serving.batching import Batcher  # noqa: E402
from deploykit.serving.metrics import Metrics  # noqa: E402
from deploykit.serving.model_host import (  # noqa: E402
    ALIGN, INLINE_BYTES, HostLink, Outbox, SharedBuffers, _packed, model_view, serve_workers)
from deploykit.serving.models import ServedModel  # noqa: E402
from deploykit.serving.protocol import RequestError  # noqa: E402
from deploykit.serving.staging import PinnedStaging, buffer_views  # noqa: E402


class Doubler:
    """Doubles its inputs and records each run's rows; a first row starting with -1 is bad input, 13 a failure."""

    backend, device, notes = "onnxruntime", "cpu", ["a note"]
    inputs = [{"name": "x", "dtype": "float32", "shape": ["batch", 3], "dynamic": {"0": {"min": 1, "opt": 2, "max": 8}}},
              {"name": "ids", "dtype": "int64", "shape": ["batch"], "dynamic": {"0": {"min": 1, "opt": 2, "max": 8}}}]
    outputs = [{"name": "y", "dtype": "float32", "shape": ["batch", 3]}, {"name": "ids2", "dtype": "int64", "shape": ["batch"]}]

    def __init__(self):
        self.batches = []

    def run(self, feeds):
        self.batches.append(len(feeds["x"]))
        if feeds["x"][0, 0] == -1:
            raise BadInputError("x[0, 0] is -1")
        if feeds["x"][0, 0] == 13:
            raise RuntimeError("no kernel for 13")
        return {"y": feeds["x"] * 2, "ids2": feeds["ids"] * 2}

    def close(self):
        pass


@contextlib.contextmanager
def linked(folder: Path, new_loop=asyncio.new_event_loop):
    """A model process's side (a batcher over Doubler, answering on a thread) and a worker's link to it
    on an event loop made by ``new_loop``: ``(link, runner, the model side's end of the pipe)``."""
    runner = Doubler()
    model = ServedModel("double", Path("double"), [runner], ["cpu"], max_batch=8, buckets=[], allow_nan=False)
    batcher = Batcher(model, max_delay_s=0, max_queue=4, metrics=Metrics())
    ours, theirs = multiprocessing.Pipe()
    outbox = Outbox()
    answering = threading.Thread(target=serve_workers, args=([ours], {"double": batcher}, outbox), daemon=True)
    answering.start()
    link = OnLoop(HostLink(theirs, folder, "w0"), new_loop)
    try:
        yield link, runner, ours
    finally:
        link.close()
        _hang_up(theirs)
        answering.join(10)
        batcher.close()
        outbox.close()
        ours.close()


@pytest.fixture
def host(tmp_path):
    with linked(tmp_path) as linked_host:
        yield linked_host


class OnLoop:
    """A HostLink driven as a worker drives it, from its event loop (here on a thread of its own),
    which reads the answers."""

    def __init__(self, link: HostLink, new_loop=asyncio.new_event_loop):
        self.link, self.loop = link, new_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(link.batcher, SimpleNamespace(name="double"), None)

    def call(self, function, *args):
        async def on_loop():
            return function(*args)
        return asyncio.run_coroutine_threadsafe(on_loop(), self.loop).result(10)

    def submit(self, model: str, inputs: dict, rows: int):
        return self.call(self.link.submit, model, inputs, rows)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        self.link.close()


def _hang_up(connection) -> None:
    """End a worker's pipe as its process's exit does: both ends see EOF at once (closing a connection that
    another thread of this process is reading leaves the socket open, and the model side waiting)."""
    with socket.socket(fileno=os.dup(connection.fileno())) as end:
        end.shutdown(socket.SHUT_RDWR)
    connection.close()


def ram_disk_full(*_):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def request(rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((rows, 3)).astype(np.float32), "ids": rng.integers(0, 1000, rows)}


def test_requests_travel_through_shared_memory_and_come_back_exactly(host, tmp_path):
    link, runner, _ = host
    sent = [request(1 + i % 3, i) for i in range(12)]
    answers = [link.submit("double", inputs, len(inputs["x"])).result(timeout=10) for inputs in sent]
    for inputs, answer in zip(sent, answers):
        np.testing.assert_array_equal(answer["y"], inputs["x"] * 2)
        np.testing.assert_array_equal(answer["ids2"], inputs["ids"] * 2)
    assert sum(runner.batches) == sum(len(inputs["x"]) for inputs in sent)
    assert len(list(tmp_path.iterdir())) == 1  # one at a time: one buffer, reused


def test_large_answers_come_back_exactly_through_the_requests_buffer(host):
    link, _, ours = host
    rows = 2
    inputs = {"x": np.random.default_rng(0).standard_normal((rows, INLINE_BYTES // 4)).astype(np.float32),
              "ids": np.arange(rows)}
    sent, send = [], ours.send
    ours.send = lambda answers: sent.append(answers) or send(answers)  # the answers as they travel
    answer = link.submit("double", inputs, rows).result(timeout=10)
    np.testing.assert_array_equal(answer["y"], inputs["x"] * 2)
    np.testing.assert_array_equal(answer["ids2"], inputs["ids"] * 2)
    assert [kind for _, kind, _ in sent[0]] == ["shm"]


def test_an_answer_goes_into_the_buffer_only_when_large_fitting_and_not_overlapping_it_misaligned(tmp_path):
    buffers = SharedBuffers(tmp_path, "w", forget=lambda path: None)
    buffer, _ = buffers.put({"x": np.ones(8, np.uint8)})
    where = buffer.memory
    large = {"y": np.arange(INLINE_BYTES // 4 + 1, dtype=np.float32)}
    request, kind, layout = _packed(7, large, where)
    assert (request, kind) == (7, "shm")
    np.testing.assert_array_equal(buffer_views(buffer.memory, layout)["y"], large["y"])
    assert _packed(1, {"y": np.ones(3)}, where)[1] == "outputs"  # small: the pipe is cheaper
    assert _packed(1, large, None)[1] == "outputs"  # the request came through the pipe
    assert _packed(1, {"y": np.zeros(buffer.size + 1, np.uint8)}, where)[1] == "outputs"  # larger than the buffer
    misaligned = {"y": np.ndarray(INLINE_BYTES + 8, np.uint8, buffer=buffer.memory, offset=8)}
    assert _packed(1, misaligned, where)[1] == "outputs"  # it would overwrite itself
    in_place = {"y": np.ndarray(16, np.float32, buffer=buffer.memory, offset=ALIGN)}  # as the GPU copied it there
    in_place["y"][:] = np.arange(16)
    request, kind, layout = _packed(2, in_place, where)
    assert (kind, layout) == ("shm", [("y", np.dtype(np.float32), (16,), ALIGN)])
    np.testing.assert_array_equal(buffer_views(buffer.memory, layout)["y"], np.arange(16))
    assert _packed(1, RequestError(400, "no"), where) == (1, "error", (400, "no", "bad_request", {}))
    buffers.close()


def test_tensors_sit_at_aligned_offsets_and_a_larger_request_gets_a_larger_buffer(tmp_path):
    buffers = SharedBuffers(tmp_path, "w", forget=lambda path: None)
    small, tensors = buffers.put({"a": np.ones(3, np.uint8), "b": np.arange(5.0)})
    kind, path, layout = tensors
    assert kind == "shm" and [offset for *_, offset in layout] == [0, ALIGN] and small.size == SharedBuffers.smallest
    large, _ = buffers.put({"a": np.zeros(3 << 20, np.uint8)})
    assert large.size == 4 << 20 and large.path != path
    buffers.release(small)
    again, _ = buffers.put({"a": np.ones(7, np.uint8)})
    assert again is small  # the free buffer that fits is reused
    buffers.close()


def read_in(view: memoryview, header: bytes, *arrays: np.ndarray) -> list[np.ndarray]:
    """A body (JSON header, then the arrays' bytes) written into ``view`` as read_body does, and the
    arrays parsed back from it as views, as protocol.parse_infer makes them."""
    body = header + b"".join(array.tobytes() for array in arrays)
    view[:] = body
    parsed, offset = [], len(header)
    for array in arrays:
        parsed.append(np.frombuffer(view, array.dtype, array.size, offset).reshape(array.shape))
        offset += array.nbytes
    return parsed


def test_tensors_read_into_a_body_buffer_stay_there(tmp_path):
    """A body read into ``SharedBuffers.body`` starts so that its binary tensors are aligned: ``put``
    takes that buffer as it is (no copy); tensors it cannot take in place (misaligned) are copied into
    another buffer, and the body's buffer comes back on exit."""
    buffers = SharedBuffers(tmp_path, "w", forget=lambda path: None)
    header, images = b'{"inputs": []}', np.arange(2 * 48, dtype=np.float32).reshape(2, 48)
    ids = np.arange(2, dtype=np.int64)
    with buffers.body(len(header) + images.nbytes + ids.nbytes, len(header)) as view:
        parsed = read_in(view, header, images, ids)
        buffer, (kind, path, layout) = buffers.put({"x": parsed[0], "ids": parsed[1]})
    assert kind == "shm" and path == buffer.path
    assert [offset % ALIGN for *_, offset in layout] == [0, 0]
    read = buffer_views(buffer.memory, layout)
    np.testing.assert_array_equal(read["x"], images)
    np.testing.assert_array_equal(read["ids"], ids)
    assert read["x"].ctypes.data == parsed[0].ctypes.data  # where it was read: not copied
    del parsed, view, read
    buffers.release(buffer)

    odd = np.arange(3, dtype=np.float32)  # 12 bytes: the tensor after it starts misaligned
    with buffers.body(len(header) + odd.nbytes + ids.nbytes, len(header)) as view:
        parsed = read_in(view, header, odd, ids)
        copied, (_, _, layout) = buffers.put({"odd": parsed[0], "ids": parsed[1]})
        lent = buffers._lent[0].buffer
    assert copied is not lent and lent in buffers._free  # the body's buffer came back
    np.testing.assert_array_equal(buffer_views(copied.memory, layout)["ids"], ids)
    del parsed, view
    buffers.close()


def test_a_body_is_read_into_the_batchers_buffer_when_its_binary_tensors_can_be_found_there(tmp_path):
    """app._body_buffer lends the batcher's buffer only for a declared, uncompressed body with a binary
    part within the limit; read_body fills it chunk by chunk, and a body shorter than declared is refused."""
    from deploykit.serving.app import _body_buffer, read_body
    from deploykit.serving.model_host import RemoteBatcher

    link = SimpleNamespace(buffers=SharedBuffers(tmp_path, "w", forget=lambda path: None))
    batcher = RemoteBatcher(link, "double")

    def lent(limit=1 << 20, **headers):
        with _body_buffer(batcher, headers, limit) as view:
            return view is not None

    binary = {"content-length": "100", "inference-header-content-length": "20"}
    assert lent(**binary)
    assert not lent(**{**binary, "content-encoding": "gzip"}) and not lent(limit=99, **binary)
    assert not lent(**{"content-length": "100"}) and not lent(**{**binary, "inference-header-content-length": "101"})

    async def received(chunks, into):
        messages = iter([{"type": "http.request", "body": chunk, "more_body": index < len(chunks) - 1}
                         for index, chunk in enumerate(chunks)])
        return await read_body(lambda: asyncio.sleep(0, next(messages)), {}, 1 << 20, into)

    into = memoryview(bytearray(10))
    assert asyncio.run(received([b"0123", b"456789"], into)) is into and bytes(into) == b"0123456789"
    with pytest.raises(RequestError, match="the body has 4 bytes where its Content-Length says 10"):
        asyncio.run(received([b"0123"], memoryview(bytearray(10))))
    link.buffers.close()


def test_a_body_buffer_answered_and_lent_again_stays_lent_when_the_first_request_ends(tmp_path):
    """The first request's buffer, taken by put() and given back when its answer came, is lent to a second
    body before the first request's handler returns: that return must not give it back a second time
    (another request would write into the body being read; seen under load as corrupted JSON headers)."""
    buffers = SharedBuffers(tmp_path, "w", forget=lambda path: None)
    first = buffers.body(64, 8)
    view = first.__enter__()
    taken, _ = buffers.put({"x": np.frombuffer(view, np.float32, 8, 8)})
    buffers.release(taken)  # the answer came back
    with buffers.body(64, 8) as second_view:
        lent_again = np.frombuffer(second_view, np.uint8).ctypes.data
        assert taken.address <= lent_again < taken.address + taken.size  # the same buffer, lent again
        first.__exit__(None, None, None)  # the first request's handler returns
        other, _ = buffers.put({"y": np.ones(100, np.uint8)})
        assert other is not taken and taken not in buffers._free
        del second_view
    del view
    buffers.close()


def test_a_buffer_still_viewed_is_unmapped_once_nothing_views_it(tmp_path):
    """A buffer given back past the budget while a request's arrays still view it (read in place, its
    handler not yet returned) is closed at a later release, not failed on."""
    buffers = SharedBuffers(tmp_path, "w", forget=lambda path: None, keep=0)
    with buffers.body(64, 8) as view:
        viewed, _ = buffers.put({"x": np.frombuffer(view, np.float32, 8, 8)})
        kept = np.frombuffer(view, np.float32, 8, 8)
    buffers.release(viewed)  # over a budget of 0: unmapped, but still viewed
    assert viewed.memory in buffers._closing and not viewed.memory.closed
    del kept, view
    other, _ = buffers.put({"x": np.ones(4, np.float32)})
    buffers.release(other)
    assert viewed.memory.closed and buffers._closing == [] and other.memory.closed
    buffers.close()


def test_free_buffers_past_the_budget_are_given_back_and_forgotten(tmp_path):
    forgotten = []
    buffers = SharedBuffers(tmp_path, "w", forget=forgotten.append, keep=SharedBuffers.smallest)
    first, _ = buffers.put({"a": np.ones(10, np.uint8)})
    second, _ = buffers.put({"a": np.ones(10, np.uint8)})
    buffers.release(first)
    buffers.release(second)  # two free buffers exceed the budget of one: the second is given back
    assert forgotten == [second.path] and not os.path.exists(second.path) and os.path.exists(first.path)
    buffers.close()
    assert not list(tmp_path.iterdir())


def test_a_full_ram_disk_sends_tensors_through_the_pipe_and_says_so_once(host, monkeypatch, caplog, tmp_path):
    link, _, _ = host
    monkeypatch.setattr(os, "posix_fallocate", ram_disk_full)
    with caplog.at_level(logging.WARNING, "deploykit.serve"):
        for seed in range(3):
            inputs = request(2, seed)
            np.testing.assert_array_equal(link.submit("double", inputs, 2).result(timeout=10)["y"], inputs["x"] * 2)
    assert caplog.text.count("no shared memory for a request buffer") == 1 and "No space left" in caplog.text
    with link.link.buffers.body(100, 20) as view:
        assert view is None  # the body is read into memory of its own, its tensors then go through the pipe
    assert not list(tmp_path.iterdir())  # nothing half-made is left


def test_answers_larger_than_the_pipe_holds_arrive_on_uvloop(tmp_path, monkeypatch):
    """uvicorn's uvloop makes a descriptor it watches non-blocking, where reading an answer still being
    written failed and the worker took the model process for gone (seen on a GPU at 64 connections)."""
    uvloop = pytest.importorskip("uvloop")
    monkeypatch.setattr(os, "posix_fallocate", ram_disk_full)  # tensors through the pipe, both ways
    with linked(tmp_path, uvloop.new_event_loop) as (link, _, _):
        assert os.get_blocking(link.link.connection.fileno())
        for seed in range(4):
            inputs = {"x": np.random.default_rng(seed).standard_normal((4, 1 << 18)).astype(np.float32),
                      "ids": np.arange(4)}  # 4 MB each way
            np.testing.assert_array_equal(link.submit("double", inputs, 4).result(timeout=10)["y"], inputs["x"] * 2)


def test_refusals_keep_their_status_and_reason(host):
    link, _, _ = host
    for first, status, reason in ((-1, 400, "bad_request"), (13, 500, "model_failed")):
        inputs = {"x": np.full((2, 3), first, np.float32), "ids": np.ones(2, np.int64)}
        with pytest.raises(RequestError) as refused:
            link.submit("double", inputs, 2).result(timeout=10)
        assert (refused.value.status, refused.value.reason) == (status, reason)
    inputs = request(1, 0)  # the link still works afterwards
    np.testing.assert_array_equal(link.submit("double", inputs, 1).result(timeout=10)["y"], inputs["x"] * 2)


def test_a_model_process_that_goes_away_answers_503(tmp_path):
    ours, theirs = multiprocessing.Pipe()
    link = OnLoop(HostLink(theirs, tmp_path, "w0"))
    waiting = link.submit("double", request(1, 0), 1)  # nobody answers it
    ours.close()
    with pytest.raises(RequestError) as refused:
        waiting.result(timeout=10)
    assert refused.value.status == 503 and "model process has stopped" in str(refused.value)
    with pytest.raises(RequestError) as later:
        link.submit("double", request(1, 1), 1)
    assert later.value.status == 503 and later.value.headers == {"Retry-After": "1"}
    link.close()


def test_workers_hold_the_models_as_facts_without_runners():
    runner = Doubler()
    model = ServedModel("double", Path("double"), [runner], ["cpu"], max_batch=8, buckets=[2, 8], allow_nan=False)
    view = model_view(model)
    assert view.runners[0] is not runner and view.inputs == runner.inputs and view.outputs == runner.outputs
    assert view.metadata() == model.metadata() and view.notes == ["a note"] and view.buckets == [2, 8]
    assert view.check({"x": np.ones((3, 3), np.float32), "ids": np.ones(3, np.int64)}) == 3


class UnpinnedTorch:
    """torch's zeros without page-locking (no GPU here): PinnedStaging's bookkeeping is what is tested."""

    def __init__(self):
        import torch

        self.torch, self.uint8 = torch, torch.uint8

    def zeros(self, size, dtype, pin_memory):
        assert pin_memory
        return self.torch.zeros(size, dtype=dtype)


def test_staging_pads_with_zero_rows_even_where_an_earlier_batch_wrote():
    pytest.importorskip("torch")
    staging = PinnedStaging(UnpinnedTorch(), None)  # assembling only: no device needed
    parts = [np.full((3, 2), 5, np.float32), np.full((2, 2), 7, np.float32)]
    full = staging.assemble("x", parts, 5, 8)
    np.testing.assert_array_equal(full, np.concatenate([*parts, np.zeros((3, 2), np.float32)]))
    buffer = full.base
    smaller = staging.assemble("x", [np.full((1, 2), 9, np.float32)], 1, 8)
    np.testing.assert_array_equal(smaller, np.concatenate([np.full((1, 2), 9), np.zeros((7, 2))]))
    assert smaller.base is buffer  # one buffer, reused
    bigger = staging.assemble("x", [np.ones((12, 2), np.float32)], 12, 16)
    np.testing.assert_array_equal(bigger, np.ones((16, 2)) * (np.arange(16) < 12)[:, None])
    other_shape = staging.assemble("x", [np.ones((2, 3), np.float32)], 2, 4)
    assert other_shape.shape == (4, 3) and not other_shape[2:].any()
