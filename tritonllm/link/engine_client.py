"""`tensorrt_llm_bls`, the bridge (`tensorrt_llm`'s face) and the OpenAI layer as clients of the engine's own process.

Where the engine runs in a process of its own (tritonllm/engine/process.py; the default on CUDA), these fronts reach
it as the engine model's instances do, over its socket, not through BLS calls (or gRPC) to the engine model: a
response costs a hop less, and with no BLS call the several engine-model instances that carry the engine's rate
cannot deadlock them (a lock-order bug of tritonserver 2.51's decoupled BLS calls). A request is read
into a `Call` by the engine model's rules, admitted against its bound, and each emission becomes the outputs the
engine model would have sent (engine_calls.py): a caller gets what a BLS call would have answered. `stop` requests
reach every caller of the engine through its process, and finished requests are counted by the engine model's
instance that reports the engine's metrics.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

from tritonllm.engine.adapters import AdapterTable
from tritonllm.engine.api import Emission
from tritonllm.engine.process import NOT_RUNNING, EngineProcess, EngineProcessError, socket_path
from tritonllm.errors import ErrorKind, TritonLLMError, error_of_kind
from tritonllm.link.engine_calls import (
    Call,
    EngineSettings,
    Finished,
    Generation,
    admit,
    engine_scope,
    error_label,
    generation_outputs,
    new_call,
    process_config,
)
from tritonllm.text.model_config import read_config

# The devices whose engine process a client looks for: one per GPU an engine-model instance runs on, or the CPU.
DEVICES = ("cpu", *(f"cuda:{index}" for index in range(16)))
RECORDS_SECONDS = 0.2  # how often finished requests are forwarded to the instance that counts them


def _joined(emissions: list[Emission]) -> list[Emission]:
    """Consecutive joinable emissions of one generation, each run as one."""
    runs: list[list[Emission]] = []
    for emission in emissions:
        if runs and Emission.joinable(runs[-1][-1], emission):
            runs[-1].append(emission)
        else:
            runs.append([emission])
    return [Emission.join(run) if len(run) > 1 else run[0] for run in runs]


class Listener(Protocol):
    """Takes a call's responses on the engine's reader thread, as they come (EngineClient.open's `listener`)."""

    def take(self, outputs: dict[str, np.ndarray]) -> None: ...

    def end(self, error: Exception | None) -> None: ...


class EngineStream:
    """One call's responses as the engine model's output arrays, in order: iterated on the caller's thread, or handed
    to a `Listener` on the engine's reader thread, where a stream of tokens costs no thread switch per token."""

    def __init__(self, client: EngineClient, engine: EngineProcess, listener: Listener | None) -> None:
        self.client = client
        self.engine = engine
        self.listener = listener
        self.call: Call | None = None  # set once read (its sender is this stream)
        self.emissions: queue.SimpleQueue = queue.SimpleQueue()
        self._over = False  # the listener was told the end

    def deliver(self, generation: Generation, emission: Emission) -> None:
        """An emission, to the listener (on the engine's reader thread); what the listener raises ends the call."""
        if self._over:
            return
        try:
            for outputs in self.convert([(generation, emission)]):
                self.listener.take(outputs)
            if not self.done:
                return
            error = None
        except Exception as exc:
            self.stop()
            error = exc
        self._over = True
        self.client.ended(self)
        self.listener.end(error)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        """Each response's arrays, on the caller's thread; the call's error (a TritonLLMError of its kind) is
        raised."""
        try:
            while not self.done:
                items = [self.emissions.get()]
                while True:
                    try:
                        items.append(self.emissions.get_nowait())
                    except queue.Empty:
                        break
                yield from self.convert(items)
        finally:
            self.client.ended(self)

    @property
    def done(self) -> bool:
        return self.call.open == 0

    def convert(self, items: list[tuple[Generation, Emission]]) -> Iterator[dict[str, np.ndarray]]:
        """The arrays of emissions taken from `emissions` (raising the call's error): a generation's that queued up
        while its caller was busy come as one response, as the engine model joins them, so a busy caller does less
        work per token, not more."""
        call = self.call
        runs: dict[int, tuple[Generation, list[Emission]]] = {}
        for generation, emission in items:
            runs.setdefault(id(generation), (generation, []))[1].append(emission)
        for generation, emissions in runs.values():
            for emission in _joined(emissions):
                if emission.error:
                    raise emission.failure()
                if emission.final:
                    call.open -= 1
                outputs = generation_outputs(generation, emission)
                if outputs is not None:
                    yield outputs

    def close(self) -> None:
        """A caller that consumed `convert` itself is done with the stream."""
        self.client.ended(self)

    def start(self) -> None:
        """Hands the call's generations to the engine; once this returns, a listener is told the end, whatever it
        is (raised here: it never started)."""
        call, engine = self.call, self.engine
        try:
            for generation in call.generations:
                generation.submitted = time.perf_counter()
                generation.engine_id = engine.submit(
                    generation.request, lambda e, g=generation: self.client.emitted(self, g, e)
                )
        except BaseException:
            self.stop()
            self.client.ended(self)
            raise
        if call.cancelled:  # stopped while being handed over (a relayed `stop`, a client that left)
            self.stop()

    def stop(self) -> None:
        """Ends the engine's work on the call at once (TensorRT-LLM's `stop`): its generations end with what they
        have, and the stream with them."""
        call = self.call
        call.cancelled = True
        for generation in call.generations:
            if generation.engine_id:
                self.engine.cancel(generation.engine_id)


class EngineClient:
    """The engine processes that the engine model's instances in the version `folder` run (one per device), joined
    on first use and again once gone; a call goes to the least loaded."""

    def __init__(self, folder: Path, settings: EngineSettings, server_pid: int | None = None) -> None:
        self.folder = folder
        self.settings = settings
        self.adapters = AdapterTable()  # an engine in a process of its own serves none
        self._scope = engine_scope(folder, server_pid)  # a stub's server is its parent
        self._lock = threading.Lock()
        self._engines: list[EngineProcess] = []
        self._live: dict[int, EngineStream] = {}
        self._records: list[Finished | str] = []  # finished requests, and refusals' error labels
        self._closed = threading.Event()
        self._forwarder = threading.Thread(target=self._forward_records, name="engine-client-records", daemon=True)
        self._forwarder.start()

    def open(self, arrays: dict[str, np.ndarray], request_id: str = "", wanted: set[str] | None = None) -> EngineStream:
        """`prepare`, then `start`: the stream, to iterate."""
        stream = self.prepare(arrays, request_id, wanted)
        stream.start()
        return stream

    def prepare(
        self,
        arrays: dict[str, np.ndarray],
        request_id: str = "",
        wanted: set[str] | None = None,
        listener: Listener | None = None,
        emissions=None,
    ) -> EngineStream:
        """A `tensorrt_llm` request's arrays as a stream of responses (to `listener`, when given), not yet handed to
        the engine. Raises InputError as the engine model refuses, ServerBusy past its bound, and an UNAVAILABLE
        error when no engine runs. `emissions`: where the emissions go for a caller that `convert`s them itself (any
        object with a thread-safe `put`; a queue that `__iter__` reads by default)."""
        try:
            stream = EngineStream(self, self._least_loaded(), listener)
            if emissions is not None:
                stream.emissions = emissions
            stream.call = call = new_call(arrays, self.settings, self.adapters, stream, request_id, wanted)
            admit(stream.engine, len(call.generations), self.settings.capacity)
        except Exception as exc:
            self._count(error_label(exc.kind if isinstance(exc, TritonLLMError) else ErrorKind.INTERNAL))
            raise
        with self._lock:
            self._live[id(stream)] = stream
        return stream

    def stop(self, request_id: str) -> None:
        """TensorRT-LLM's `stop` request: every caller's calls that carry the client's `request_id` end."""
        engines = self._connected()
        engines[0].relay_stop(request_id)  # the engine's process relays it to every connection, this one's too

    def engine(self) -> EngineProcess:
        """One of the engines (the health probe's, the adapter administration's)."""
        return self._least_loaded()

    def ended(self, stream: EngineStream) -> None:
        with self._lock:
            self._live.pop(id(stream), None)

    def close(self) -> None:
        self._closed.set()
        self._forwarder.join()
        with self._lock:
            engines, self._engines = self._engines, []
        for engine in engines:
            engine.shutdown()

    # ------------------------------------------------------------------ the engines

    def _least_loaded(self) -> EngineProcess:
        return min(self._connected(), key=lambda engine: engine.running())

    def _connected(self) -> list[EngineProcess]:
        with self._lock:
            engines = [engine for engine in self._engines if engine.alive()]
            if not engines:
                engines = self._join()
            self._engines = engines
        if not engines:
            raise error_of_kind(ErrorKind.UNAVAILABLE, NOT_RUNNING)
        return engines

    def _join(self) -> list[EngineProcess]:
        """The engine processes running now for this folder (looked for by their sockets: none is started here)."""
        engines, seen = [], set()
        for device in DEVICES:
            config = process_config(self.folder, device)
            if config is None:
                continue
            path = socket_path(config, self._scope)
            if path in seen or not path.exists():
                continue
            seen.add(path)
            try:
                engines.append(EngineProcess(config, self._scope, self._stopped, start=False))
            except EngineProcessError:
                continue  # gone meanwhile
        return engines

    # ------------------------------------------------------------------ from the engines' reader threads

    def emitted(self, stream: EngineStream, generation: Generation, emission: Emission) -> None:
        """An emission of one of `stream`'s generations, on the engine's reader thread."""
        generation.took(emission)
        if emission.final:
            request = generation.request
            self._count(Finished(emission, len(request.input_ids), generation.generated, request.adapter))
        if not generation.sends(emission):
            return
        if stream.listener is not None:
            stream.deliver(generation, emission)
        else:
            stream.emissions.put((generation, emission))

    def _count(self, record: Finished | str) -> None:
        with self._lock:
            self._records.append(record)

    def _stopped(self, request_id: str) -> None:
        """A `stop` request relayed by the engine's process."""
        with self._lock:
            streams = [stream for stream in self._live.values() if stream.call.request_id == request_id]
        for stream in streams:
            stream.stop()

    def _forward_records(self) -> None:
        while not self._closed.wait(RECORDS_SECONDS):
            with self._lock:
                records, self._records = self._records, []
                engines = list(self._engines)
            if records and engines:
                engines[0].forward_records(records)


def client_for(repository: Path, engine_model: str, server_pid: int | None = None) -> EngineClient | None:
    """A client of the engine's process when `engine_model`'s engine runs in one (the engine's configuration in its
    latest version folder says so) for the server `server_pid` (a stub's parent when None); None when its callers
    call the engine model through Triton (an engine in the model's process, or NVIDIA's)."""
    model = repository / engine_model
    versions = sorted((int(p.name) for p in model.iterdir() if p.name.isdigit()), reverse=True)
    if not versions or process_config(model / str(versions[0]), "cpu") is None:
        return None
    config = read_config(model / "config.pbtxt")
    params = {key: value.string_value for key, value in config.parameters.items()}
    return EngineClient(model / str(versions[0]), EngineSettings.of(params, config.max_batch_size), server_pid)
