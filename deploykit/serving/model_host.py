"""``deploykit serve --workers N``: N HTTP processes in front of one model process.

One Python process cannot parse requests as fast as a GPU answers them (a 224x224 fp32 image is
600 KB of body to read, decode and check). Running N whole servers, each with its own runners,
splits the traffic into N small batches padded up to the bucket, loads every bundle N times and
makes the GPU take turns between N CUDA contexts. Here the N workers only speak HTTP: each reads a
request's body into a buffer in shared memory (where its binary tensors then lie, aligned: they are
not copied again), parses and checks it, and sends a few bytes to the model process over its pipe;
the model process holds the runners and the batchers (the same ``Batcher`` as a one-process
server), batches requests from every worker together, and answers each worker over its pipe.

In the model process one thread reads every worker's pipe and one sends the answers: the batchers
never wait on a pipe, and the answers a batch settles for one worker travel as one message. An
answer's tensors larger than ``INLINE_BYTES`` are written into the request's own buffer (its inputs
are spent once the batch ran) rather than pickled through the pipe: a BERT answer is hundreds of KB.

Shared memory is files in one folder on a RAM disk (``/dev/shm``), one per request buffer, reused
across requests so that their pages are faulted in once. A buffer is allocated up front
(``posix_fallocate``): where the RAM disk is full, the request's tensors travel through the pipe
instead, never as a crash on a page that cannot be backed. Where the models run on a GPU, the model
process page-locks each buffer when it first maps it (``staging.HostRegistry``), so that a batch's
rows go from the buffers the workers wrote them in straight to the GPU (``staging.DeviceStaging``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import mmap
import multiprocessing.connection
import os
import signal
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from deploykit.serving.protocol import RequestError
from deploykit.serving.staging import (ALIGN, DeviceStaging, HostRegistry, buffer_address, buffer_layout,
                                       buffer_views)

log = logging.getLogger("deploykit.serve")
#: An answer's tensors up to this size go through the pipe; larger ones into the request's buffer.
INLINE_BYTES = 64 << 10


@dataclasses.dataclass
class RunnerFacts:
    """What an HTTP worker knows of a runner in the model process: enough to check requests
    against the manifest and to describe the model (metadata, config, the console's summary)."""

    backend: str
    device: str
    inputs: list[dict]
    outputs: list[dict]
    notes: list[str]

    def close(self) -> None:
        """Nothing to release: the runner lives in the model process."""


def model_view(model):
    """A ServedModel as the HTTP workers hold it: the same batching facts, its runners as facts."""
    facts = [RunnerFacts(r.backend, r.device, r.inputs, r.outputs, list(r.notes)) for r in model.runners]
    return dataclasses.replace(model, runners=facts)


# The worker's side ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Buffer:
    path: str
    size: int
    memory: mmap.mmap

    @functools.cached_property
    def address(self) -> int:
        return buffer_address(self.memory)


@dataclasses.dataclass(eq=False)  # one lending of a buffer, told apart from its later lendings
class _Lease:
    buffer: Buffer


class SharedBuffers:
    """One worker's request buffers: files in ``folder`` that it writes tensors into and the model
    process maps. A free buffer is reused for the next request it fits; more than ``keep`` bytes of
    free buffers are given back (``forget(path)`` tells the model process to drop its mapping). Used
    from the worker's event loop alone, as its HostLink is."""

    smallest = 1 << 20

    def __init__(self, folder: Path | None, prefix: str, forget, keep: int = 64 << 20):
        self.folder, self.prefix, self.forget, self.keep = folder, prefix, forget, keep
        self._free: list[Buffer] = []
        self._lent: list[_Lease] = []  # the buffers bodies are being read into
        self._closing: list[mmap.mmap] = []  # given back while arrays of a finishing request still viewed them
        self._names = itertools.count()
        self._full_noted = False

    @contextlib.contextmanager
    def body(self, size: int, header_length: int):
        """A writable view of ``size`` bytes in a buffer, to read a request's body into (None where no
        buffer can be had). It starts where the binary tensors after the body's JSON header of
        ``header_length`` bytes fall aligned, so that ``put`` finds them in place and copies nothing.
        The buffer comes back here on exit unless ``put`` took it for the request."""
        lead = -header_length % ALIGN
        buffer = self._take(lead + size)
        if buffer is None:
            yield None
            return
        lease = _Lease(buffer)  # this lending's: once put() took the buffer, it may be lent again before we exit
        self._lent.append(lease)
        try:
            yield memoryview(buffer.memory)[lead:lead + size]
        finally:
            if lease in self._lent:
                self._lent.remove(lease)
                self.release(buffer)

    def put(self, inputs: dict[str, np.ndarray]) -> tuple[Buffer | None, tuple]:
        """The tensors written into a buffer, and how the model process finds them: ``("shm", path,
        [(name, dtype, shape, offset)])``, or ``("inline", inputs)`` where no buffer can be had. Tensors
        that already lie, aligned, in a buffer their body was read into (``body``) stay where they are."""
        if any(array.dtype.hasobject for array in inputs.values()):
            return None, ("inline", inputs)
        for lease in self._lent:
            if (layout := _layout_in(lease.buffer.address, lease.buffer.size, inputs)) is not None:
                self._lent.remove(lease)
                return lease.buffer, ("shm", lease.buffer.path, layout)
        layout, end = _layout(inputs)
        buffer = self._take(max(end, 1))
        if buffer is None:
            return None, ("inline", inputs)
        _write(buffer.memory, layout, inputs)
        return buffer, ("shm", buffer.path, layout)

    def release(self, buffer: Buffer | None) -> None:
        """A buffer whose request was answered (the model process no longer reads it)."""
        if buffer is None:
            return
        self._free.append(buffer)
        if sum(b.size for b in self._free) <= self.keep:
            return
        self._free.remove(buffer)
        self.forget(buffer.path)
        self._unmap([buffer.memory, *self._closing])
        with contextlib.suppress(OSError):
            os.unlink(buffer.path)

    def close(self) -> None:
        self._unmap([buffer.memory for buffer in self._free] + self._closing)
        for buffer in self._free:
            with contextlib.suppress(OSError):
                os.unlink(buffer.path)
        self._free.clear()

    def _unmap(self, memories: list[mmap.mmap]) -> None:
        """Close each mapping; one that arrays still view (a request's inputs, read in place, until its
        handler returns) is kept for a later try."""
        self._closing = []
        for memory in memories:
            try:
                memory.close()
            except BufferError:
                self._closing.append(memory)

    def _take(self, size: int) -> Buffer | None:
        fitting = [b for b in self._free if b.size >= size]
        if fitting:
            chosen = min(fitting, key=lambda b: b.size)
            self._free.remove(chosen)
            return chosen
        return self._create(max(self.smallest, 1 << (size - 1).bit_length()))

    def _create(self, size: int) -> Buffer | None:
        if self.folder is None:
            return None
        path = str(self.folder / f"{self.prefix}-{next(self._names)}")
        try:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as error:
            return self._no_buffer(path, error, None)
        try:
            os.posix_fallocate(descriptor, 0, size)  # fails now (ENOSPC) rather than SIGBUS on a later write
            return Buffer(path, size, mmap.mmap(descriptor, size))
        except OSError as error:
            return self._no_buffer(path, error, descriptor)
        finally:
            os.close(descriptor)

    def _no_buffer(self, path: str, error: OSError, descriptor: int | None) -> None:
        if descriptor is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if not self._full_noted:
            self._full_noted = True
            log.warning("no shared memory for a request buffer in %s (%s): requests go through the pipe to the "
                        "model process, which is slower; give the RAM disk more room", self.folder,
                        error.strerror or error)
        return None


class HostLink:
    """A worker's end of its pipe to the model process: requests out, answers in, both on the worker's
    event loop. Answers are read there rather than on a thread of their own: such a thread, back from
    waiting on the pipe, has to take the GIL from the event loop, which under load runs Python
    without pause and gives it up only every switch interval (5 ms)."""

    def __init__(self, connection, buffers_folder: Path | None, prefix: str):
        self.connection = connection
        self.buffers = SharedBuffers(buffers_folder, prefix, forget=lambda path: self._send(("forget", path)))
        self._pending: dict[int, tuple[Future, Buffer | None]] = {}
        self._ids = itertools.count()
        self._gone: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def batcher(self, model, _metrics) -> RemoteBatcher:
        """The app's batcher of ``model`` (``create_app``'s ``batcher_for``, called on the event loop,
        which then reads the answers)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self.connection.fileno(), self._receive)
            # uvloop's add_reader makes the descriptor non-blocking, where recv would then fail
            # (BlockingIOError) on an answer that is still being written: keep it blocking
            os.set_blocking(self.connection.fileno(), True)
        return RemoteBatcher(self, model.name)

    def submit(self, model: str, inputs: dict[str, np.ndarray], rows: int) -> Future:
        if self._gone is not None:
            raise RequestError(503, self._gone, "model_process", {"Retry-After": "1"})
        future: Future = Future()
        buffer, tensors = self.buffers.put(inputs)
        request = next(self._ids)
        self._pending[request] = (future, buffer)
        self.connection.send(("infer", request, model, tensors, rows))
        return future

    def _send(self, message) -> None:
        if self._gone is None:
            self.connection.send(message)

    def _receive(self) -> None:
        """One message of answers (the loop calls again while the pipe has more)."""
        try:
            answers = self.connection.recv()
        except (EOFError, OSError):
            self._lost()
            return
        for request, kind, payload in answers:
            future, buffer = self._pending.pop(request)
            if kind == "shm":  # copied out: the buffer serves the next request
                payload = {name: array.copy() for name, array in buffer_views(buffer.memory, payload).items()}
            self.buffers.release(buffer)
            _settle(future, kind, payload)

    def _lost(self) -> None:
        self._loop.remove_reader(self.connection.fileno())
        self._gone = "the model process has stopped: the server is shutting down or failed (see its log)"
        pending, self._pending = self._pending, {}
        for future, _buffer in pending.values():
            _settle(future, "error", _as_error(RequestError(503, self._gone, "model_process", {"Retry-After": "1"})))

    def close(self) -> None:
        self.buffers.close()


class RemoteBatcher:
    """The app's batcher of one model in an HTTP worker: requests go to the model process's batcher."""

    def __init__(self, link: HostLink, name: str):
        self.link, self.name = link, name

    def submit(self, inputs: dict[str, np.ndarray], rows: int, connection=None) -> Future:
        return self.link.submit(self.name, inputs, rows)

    def body_buffer(self, size: int, header_length: int):
        """Where to read a request's body: shared memory the model process reads its tensors from
        (``SharedBuffers.body``), so that they are not copied again."""
        return self.link.buffers.body(size, header_length)

    def arriving(self, connection=None):
        """The model process does not see requests still being read, nor which connection a request
        came on: it waits only while its rows would be padded (``Batcher._take``)."""
        return contextlib.nullcontext()

    def wait_warm(self) -> None:
        """The model process sends the models only once every runner is warm."""

    def close(self) -> None:
        """The model process finishes what it queued once every worker has gone."""


def _settle(future: Future, kind: str, payload) -> None:
    if not future.set_running_or_notify_cancel():  # the request timed out meanwhile
        return
    if kind == "error":
        future.set_exception(RequestError(*payload))
    else:
        future.set_result(payload)


def _layout(arrays: dict[str, np.ndarray]) -> tuple[list[tuple], int]:
    """Where each array goes in a buffer, ``[(name, dtype, shape, offset)]``, and the bytes they take."""
    return buffer_layout((name, array.dtype, array.shape) for name, array in arrays.items())


def _layout_in(address: int, size: int, arrays: dict[str, np.ndarray]) -> list[tuple] | None:
    """The layout of ``arrays`` where each is a contiguous, aligned stretch of the ``size`` bytes at
    ``address`` (a buffer); else None."""
    layout = []
    for name, array in arrays.items():
        offset = array.ctypes.data - address
        if offset % ALIGN or not 0 <= offset <= size - array.nbytes or not array.flags.c_contiguous:
            return None
        layout.append((name, array.dtype, array.shape, offset))
    return layout


def _write(memory: mmap.mmap, layout: list[tuple], arrays: dict[str, np.ndarray]) -> None:
    for view, (name, *_) in zip(buffer_views(memory, layout).values(), layout):
        np.copyto(view, arrays[name])


def _as_error(error: Exception) -> tuple:
    """A RequestError as the fields it is made of (an exception with such arguments does not pickle)."""
    if not isinstance(error, RequestError):
        error = RequestError(500, f"internal error: {type(error).__name__}", "internal")
    return error.status, str(error), error.reason, error.headers


# The model process's side --------------------------------------------------------------------------


class Outbox:
    """The answers to the workers, sent by a thread of their own: a batcher settles its batch and
    goes on to the next one, and what it settled for one worker goes out as one message. Tensors
    larger than ``INLINE_BYTES`` are written into the request's buffer here, off the batcher."""

    def __init__(self):
        self._ready = threading.Condition()
        self._waiting: dict = {}  # connection -> [(request, answer, buffer)]
        self._closed = False
        self._sender = threading.Thread(target=self._send_all, name="answers", daemon=True)
        self._sender.start()

    def put(self, connection, request: int, answer, buffer: mmap.mmap | None) -> None:
        """``answer``: the outputs, or an exception; ``buffer``: the request's mapped buffer, if any."""
        with self._ready:
            self._waiting.setdefault(connection, []).append((request, answer, buffer))
            self._ready.notify()

    def close(self) -> None:
        """Send what is waiting, then stop."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._sender.join()

    def _send_all(self) -> None:
        while True:
            with self._ready:
                while not self._waiting and not self._closed:
                    self._ready.wait()
                if not self._waiting:
                    return
                waiting, self._waiting = self._waiting, {}
            for connection, answers in waiting.items():
                try:
                    connection.send([_packed(*answer) for answer in answers])
                except OSError:  # the worker has gone: nobody waits for these answers
                    pass


def _packed(request: int, answer, buffer: mmap.mmap | None) -> tuple:
    """``(request, kind, payload)``: kind ``error`` (RequestError's fields), ``shm`` (the outputs'
    layout in the request's buffer: written there now, or where the GPU copied them, ``DeviceStaging``)
    or ``outputs``."""
    if isinstance(answer, BaseException):
        return request, "error", _as_error(answer)
    if buffer is not None and (placed := _layout_in(buffer_address(buffer), len(buffer), answer)) is not None:
        return request, "shm", placed
    layout, size = _layout(answer)
    if buffer is None or size <= INLINE_BYTES or size > len(buffer) or any(a.dtype.hasobject for a in answer.values()):
        return request, "outputs", answer
    memory = np.frombuffer(buffer, np.uint8)
    if any(np.may_share_memory(array, memory) for array in answer.values()):  # an output aliasing its input
        return request, "outputs", answer
    _write(buffer, layout, answer)
    return request, "shm", layout


def serve_workers(connections: list, batchers: dict, outbox: Outbox, registry: HostRegistry | None = None) -> None:
    """Answer the workers' requests until each has closed its pipe; each runs in its model's batcher.
    One thread reads every pipe: a thread per worker would only contend for the GIL. ``registry``:
    where the models run on a GPU, each request buffer is page-locked when first mapped."""
    mapped: dict[str, mmap.mmap] = {}  # buffer paths are unique across workers (``w<index>-<n>``)
    live = list(connections)
    while live:
        for connection in multiprocessing.connection.wait(live):
            try:
                message = connection.recv()
            except (EOFError, OSError):
                live.remove(connection)
                continue
            if message[0] == "forget":
                memory = mapped.pop(message[1], None)  # unmapped once the last array viewing it is gone
                if memory is not None and registry is not None:
                    registry.remove(memory)
                continue
            _, request, name, tensors, rows = message
            arrays, buffer = _arrays(tensors, mapped, registry)
            try:
                future = batchers[name].submit(arrays, rows)
            except RequestError as error:
                outbox.put(connection, request, error, None)
                continue
            future.add_done_callback(functools.partial(_answer, outbox, connection, request, buffer))


def _answer(outbox: Outbox, connection, request: int, buffer: mmap.mmap | None, done: Future) -> None:
    """A settled request's outputs, or its exception, to its worker."""
    outbox.put(connection, request, done.exception() or done.result(), buffer)


def _arrays(tensors: tuple, mapped: dict[str, mmap.mmap],
            registry: HostRegistry | None = None) -> tuple[dict[str, np.ndarray], mmap.mmap | None]:
    """A request's arrays, and its mapped buffer where it came in one (page-locked by ``registry``)."""
    kind, *where = tensors
    if kind == "inline":
        return where[0], None
    path, layout = where
    memory = mapped.get(path)
    if memory is None:
        with open(path, "r+b") as file:
            memory = mapped[path] = mmap.mmap(file.fileno(), 0)
        if registry is not None:
            registry.add(memory)
    return buffer_views(memory, layout), memory


def run_model_process(paths, options, limits, connections, events) -> None:
    """The model process: load every bundle once, warm the runners up, send the workers the models,
    then answer their requests until every worker has closed its pipe (or SIGTERM), finishing what
    is queued. SIGINT is left to the workers (Ctrl-C reaches them all): they stop first, then this."""
    from deploykit.errors import DeployKitError, EnvironmentProblem
    from deploykit.serving.batching import Batcher
    from deploykit.serving.metrics import Metrics
    from deploykit.serving.models import load_models
    from deploykit.serving.server import configure_logging, model_summary

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    configure_logging(access_log=False)
    try:
        models = load_models(paths, options)
    except DeployKitError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        events.put(("models", error.exit_code, None))
        sys.exit(error.exit_code)
    metrics = Metrics()
    lost: list[str] = []

    def stop_lost(message: str) -> None:  # a GPU's CUDA context is lost: finish, then exit 3 (gpu_health)
        log.critical(message)
        lost.append(message)
        stopping.set()

    registry = HostRegistry.for_models(models)
    staging_for = functools.partial(DeviceStaging.for_runner, registry=registry)
    batchers = {model.name: Batcher(model, limits.max_delay_ms / 1e3, limits.max_queue, metrics, on_lost=stop_lost,
                                    staging_for=staging_for)
                for model in models}
    for batcher in batchers.values():
        batcher.wait_warm()
    views = [model_view(model) for model in models]
    for connection in connections:
        connection.send(views)
    outbox = Outbox()
    answering = threading.Thread(target=serve_workers, args=(connections, batchers, outbox, registry),
                                 daemon=True)
    answering.start()
    events.put(("models", None, [(model.name, model.notes, model_summary(model)) for model in models]))
    while not stopping.is_set() and answering.is_alive():
        stopping.wait(0.2)
    for batcher in batchers.values():
        batcher.close()
    outbox.close()
    for model in models:
        for runner in model.runners:
            runner.close()
    if lost:
        sys.exit(EnvironmentProblem.exit_code)

