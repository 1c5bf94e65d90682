"""The OpenAI layer's direct path: one gRPC stream to the engine model per choice, carrying the per-request pipeline.

Where the repository is at hand and the engine streams (the portable flavor), each choice is a `StreamedRequest`
(tritonllm/text/pipeline.py) run here, in the layer's worker process: tokenized with the preprocessing model's
own step and wiring, streamed from the engine model (`tensorrt_llm_decoupled`, or `tensorrt_llm` in the
decoupled deployment), and detokenized here. `tensorrt_llm_bls` does the same inside Triton; this path saves
its hop and spreads the text work over the layer's workers. A stop string ends the engine's work with
TensorRT-LLM's `stop` request on the same stream, and the engine's final response (its perf metrics) is still
awaited, as tensorrt_llm_bls does.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import np_to_triton_dtype

from tritonllm.errors import TritonLLMError
from tritonllm.openai.engine_process import EngineProcessRoute
from tritonllm.openai.errors import triton_error
from tritonllm.openai.models import USAGE_PERF_OUTPUT, APIError
from tritonllm.protocol import PERF_OUTPUTS, infer_inputs, stop_request_tensors
from tritonllm.text.pipeline import Delta, Parts, StreamedRequest

EMPTY_FINAL = {"triton_enable_empty_final_response": True}  # so a flags-only last response reaches the client


def grpc_inputs(arrays: dict[str, np.ndarray]) -> list[grpcclient.InferInput]:
    return infer_inputs(grpcclient, [(name, array, np_to_triton_dtype(array.dtype)) for name, array in arrays.items()])


class EngineStreams:
    """Streams each choice from the engine model, with the pipeline run in this process: from the engine's own
    process directly where the engine runs in one on this host (engine_process.py), else over gRPC."""

    def __init__(self, parts: Parts, engine_model: str, repository: Path | None = None, grpc_url: str = "") -> None:
        self.parts, self.engine_model = parts, engine_model
        self.process = EngineProcessRoute(repository, engine_model, grpc_url) if repository is not None else None

    def request(
        self, arrays: dict[str, np.ndarray], prompt_ids: list[int] | None = None, token_ids: bool = False
    ) -> StreamedRequest:
        """The choice's pipeline; a client mistake is the 400 that names it, as tensorrt_llm_bls would answer."""
        try:
            return self.parts.request(arrays, prompt_ids, token_ids)
        except TritonLLMError as exc:
            raise APIError(exc.kind, str(exc)) from None

    async def stream(
        self, client: grpcaio.InferenceServerClient, pipeline: StreamedRequest
    ) -> AsyncIterator[dict[str, np.ndarray]]:
        """The choice's responses as tensorrt_llm_bls's tensors: text deltas, then the final response's."""
        engine = self.process.client() if self.process is not None else None
        deltas = self.deltas(client, pipeline) if engine is None else self.process.deltas(engine, pipeline)
        async with contextlib.aclosing(deltas) as deltas:  # closed at once if we stop early
            async for delta in deltas:
                yield pipeline.delta_tensors(delta)
        yield pipeline.final(pipeline.perf_metrics)

    async def deltas(self, client: grpcaio.InferenceServerClient, pipeline: StreamedRequest) -> AsyncIterator[Delta]:
        """The choice's deltas as the engine streams them; once they end, `pipeline.perf_metrics` holds the engine's
        final response's perf metrics (when the request asked for them)."""
        request_id = uuid.uuid4().hex
        engine_outputs = [n for n in pipeline.engine_outputs() if n not in PERF_OUTPUTS or n == USAGE_PERF_OUTPUT]
        token_outputs = [name for name in engine_outputs if name not in PERF_OUTPUTS]
        wake = asyncio.Event()  # the engine answered in full, or the choice needs its `stop`
        stop = False

        async def requests():
            yield {
                "model_name": self.engine_model,
                "inputs": grpc_inputs(pipeline.engine_inputs()),
                "outputs": [grpcclient.InferRequestedOutput(name) for name in engine_outputs],
                "request_id": request_id,
                "parameters": EMPTY_FINAL,
            }
            await wake.wait()  # the stream stays open for a `stop` until the engine's final response
            if stop:
                inputs = infer_inputs(grpcclient, stop_request_tensors())
                yield {"model_name": self.engine_model, "inputs": inputs, "request_id": request_id}

        responses = client.stream_infer(requests())
        finished = False

        def abort() -> None:  # for a caller that learns of a cancellation outside this loop (Dynamo's worker)
            pipeline.abort = None
            if not finished:
                responses.cancel()

        pipeline.abort = abort
        try:
            async for result, error in responses:
                if error is not None:
                    finished = True  # an error ends the request
                    raise triton_error(error)
                if not stop:
                    outputs = {n: a for n in token_outputs if (a := result.as_numpy(n)) is not None}
                    delta = pipeline.push(outputs)
                    if delta is not None:
                        yield delta
                    if pipeline.stopped:
                        stop = True
                        wake.set()
                parameters = result.get_response().parameters
                if "triton_final_response" in parameters and parameters["triton_final_response"].bool_param:
                    # The engine sends its perf metrics with every response; the final one's are the request's.
                    if pipeline.perf:
                        pipeline.perf_metrics = {n: a for n in PERF_OUTPUTS if (a := result.as_numpy(n)) is not None}
                    break
            finished = True
        finally:
            wake.set()  # ends the request stream: the call completes once the server has answered
            # Ends the request in Triton if we stop early (the client went away). Not after the final
            # response: a cancellation arriving then leaves tritonserver 2.51 unable to unload the model.
            pipeline.abort = None
            if not finished:
                responses.cancel()
