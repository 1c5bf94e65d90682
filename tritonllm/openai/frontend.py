"""An OpenAI-compatible API in front of the running Triton server.

    python -m tritonllm.openai.frontend --grpc-url 127.0.0.1:8001 --tokenizer-dir DIR [--port 9000]

`GET /v1/models`, `POST /v1/completions` and `POST /v1/chat/completions` (with `stream: true` as
server-sent events ending in `data: [DONE]`), so the `openai` client, LangChain, LiteLLM and chat
UIs work unchanged. It is a thin FastAPI layer: chat messages go through the tokenizer's chat
template, and every generation is one gRPC stream to the `tensorrt_llm_bls` model (a client that
disconnects cancels its stream, which frees its place in the engine). No model is loaded here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from tritonclient.utils import InferenceServerException

from tritonllm.errors import ErrorKind
from tritonllm.protocol import MAX_WORD_BYTES, MAX_WORDS, infer_inputs, request_tensors

FINISH_REASONS = {"length": "length", "stop": "stop", "eos": "stop"}
MAX_STOPS = min(4, MAX_WORDS)  # OpenAI's limit, within what the models take

# OpenAI's error `type` where it is not "invalid_request_error".
OPENAI_TYPES = {
    ErrorKind.BUSY: "rate_limit_exceeded",
    ErrorKind.UNAVAILABLE: "server_error",
    ErrorKind.INTERNAL: "server_error",
}

# Triton's own errors, which carry no kind tag, by their text: inside a gRPC stream an error has no
# status code. Only Triton's wording here, never ours (our models tag theirs).
TRITON_MESSAGES: tuple[tuple[str, ErrorKind], ...] = (
    # triton-inference-server/core src/scheduler_utils.cc, PriorityQueue::PolicyQueue::Enqueue (UNAVAILABLE):
    # a dynamic batcher's queue is full (`default_queue_policy { max_queue_size }`, the TensorRT-LLM flavor).
    ("Exceeds maximum queue size", ErrorKind.BUSY),
    # triton-inference-server/core src/dynamic_batch_scheduler.cc (UNAVAILABLE): a request waited in that
    # queue longer than its policy's timeout.
    ("Request timeout expired", ErrorKind.BUSY),
)

# Triton's status codes (gRPC's names, as tritonclient.grpc reports them), for errors without a tag or known text.
TRITON_STATUSES = {
    "StatusCode.INVALID_ARGUMENT": ErrorKind.INVALID_INPUT,
    "StatusCode.RESOURCE_EXHAUSTED": ErrorKind.TOO_LARGE,  # a message over gRPC's size limit
    "StatusCode.UNAVAILABLE": ErrorKind.UNAVAILABLE,
    # The client named the right model (checked here): Triton missing its own model is the server's state.
    "StatusCode.NOT_FOUND": ErrorKind.UNAVAILABLE,
}

T = TypeVar("T")


class APIError(Exception):
    """An error in OpenAI's format, {"error": {"message", "type", "param", "code"}}, with its kind's status."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind, self.param, self.code = kind, param, code
        self.status = kind.http_status
        self.type = OPENAI_TYPES.get(kind, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Accepted at their neutral values only: the engine cannot honour them, and silently ignoring them would mislead.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | int | None = None
    tools: list | None = None
    response_format: dict | None = None

    def check_supported(self) -> None:
        """Refuse, before any request is sent, what this server cannot honour or the models would refuse."""
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
            if getattr(self, name) != neutral:
                raise APIError(ErrorKind.INVALID_INPUT, f"'{name}' is not supported by this server", param=name)
        for name in ("logprobs", "tools"):
            if getattr(self, name):
                raise APIError(ErrorKind.INVALID_INPUT, f"'{name}' is not supported by this server", param=name)
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError(
                ErrorKind.INVALID_INPUT, "only response_format {'type': 'text'} is supported", param="response_format"
            )
        self.stops()

    def stops(self) -> list[str]:
        """The stop sequences, checked here: the models would refuse them too, but only once a request runs."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise APIError(ErrorKind.INVALID_INPUT, f"'stop' takes at most {MAX_STOPS} sequences", param="stop")
        for stop in stops:
            if len(stop.encode()) > MAX_WORD_BYTES:
                raise APIError(
                    ErrorKind.INVALID_INPUT,
                    f"'stop': a sequence is {len(stop.encode())} bytes, over the limit of {MAX_WORD_BYTES}",
                    param="stop",
                )
        return stops


class CompletionRequest(SamplingRequest):
    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(
                    ErrorKind.INVALID_INPUT,
                    f"only text content is supported, got a '{part.get('type')}' part",
                    param="messages",
                )
            parts.append(part.get("text", ""))
        return "".join(parts)


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


@dataclass(frozen=True)
class Settings:
    grpc_url: str
    tokenizer_dir: str
    model_name: str
    max_input_len: int
    max_seq_len: int
    api_key: str | None = None
    triton_model: str = "tensorrt_llm_bls"


@dataclass
class Generation:
    """One choice: its text (whole, or streamed as deltas) and, at the end, why and how long."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


def create_app(settings: Settings) -> FastAPI:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_dir)
    triton: dict[str, grpcaio.InferenceServerClient] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if "client" in triton:
            await triton["client"].close()

    app = FastAPI(title="tritonllm OpenAI-compatible API", lifespan=lifespan)
    created = int(time.time())

    def client() -> grpcaio.InferenceServerClient:
        if "client" not in triton:  # created inside the server's event loop
            triton["client"] = grpcaio.InferenceServerClient(settings.grpc_url)
        return triton["client"]

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        """A body that is not JSON or has a wrong type: a client's mistake, 400 as every other (FastAPI says 422)."""
        first = exc.errors()[0]
        # The place after "body": the field and its path (with pydantic's union members), or a malformed JSON's offset.
        where = [str(p) for p in first.get("loc", ())[1:]] if first.get("type") != "json_invalid" else []
        param = where[0] if where else None
        return APIError(
            ErrorKind.INVALID_INPUT, f"{'.'.join(where) or 'body'}: {first.get('msg')}", param=param
        ).response()

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if settings.api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not secrets.compare_digest(given, settings.api_key):
                return APIError(
                    ErrorKind.UNAUTHORIZED, "Incorrect or missing API key", code="invalid_api_key"
                ).response()
        return await call_next(request)

    def model_card() -> dict:
        return {"id": settings.model_name, "object": "model", "created": created, "owned_by": "tritonllm"}

    def check_model(name: str) -> None:
        if name != settings.model_name:
            raise APIError(
                ErrorKind.NOT_FOUND,
                f"The model `{name}` does not exist; this server serves `{settings.model_name}`",
                param="model",
                code="model_not_found",
            )

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name}")
    async def get_model(name: str) -> dict:
        check_model(name)
        return model_card()

    @app.get("/health")
    async def health() -> dict:
        try:
            return {"ready": await client().is_server_ready()}
        except InferenceServerException as exc:
            raise triton_error(exc) from None

    async def generate(prompt: str, body: SamplingRequest, max_tokens: int, index: int) -> AsyncIterator[Generation]:
        """Stream one choice from Triton: deltas (finish_reason None), then a final Generation."""
        seed = None if body.seed is None else (body.seed + index) % 2**64
        tensors = request_tensors(
            prompt, max_tokens, temperature=body.temperature, top_p=body.top_p, seed=seed, stop=body.stops(), chat=False
        )
        tensors.append(("stream", np.array([[True]]), "BOOL"))
        inputs = infer_inputs(grpcclient, tensors)

        async def requests():
            yield {"model_name": settings.triton_model, "inputs": inputs, "request_id": uuid.uuid4().hex}

        responses = client().stream_infer(requests())
        finished = False
        try:
            async for result, error in responses:
                if error is not None:
                    finished = True  # an error ends the request
                    raise triton_error(error)
                text = result.as_numpy("text_output")
                generation = Generation(index, text.reshape(-1)[0].decode() if text is not None else "")
                reason = result.as_numpy("finish_reason")
                if reason is not None:
                    generation.finish_reason = FINISH_REASONS.get(reason.reshape(-1)[0].decode(), "stop")
                    generation.prompt_tokens = int(result.as_numpy("num_input_tokens").reshape(-1)[0])
                    generation.completion_tokens = int(result.as_numpy("num_output_tokens").reshape(-1)[0])
                    finished = True
                    yield generation
                    return
                yield generation
        except grpc.RpcError as exc:  # the call itself failed: Triton not reachable, or the stream was cut
            raise triton_error(InferenceServerException(msg=exc.details(), status=str(exc.code()))) from None
        finally:
            # Ends the request in Triton if we stop early (the client went away). Not after the final
            # response: a cancellation arriving then leaves tritonserver 2.51 unable to unload the model.
            if not finished:
                responses.cancel()

    adds_bos = bool(tokenizer.bos_token_id is not None and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id])

    def chat_prompt(messages: list[dict]) -> str:
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # Preprocessing adds the tokenizer's special tokens: a template that writes BOS itself would double it.
        if adds_bos and prompt.startswith(tokenizer.bos_token):
            prompt = prompt[len(tokenizer.bos_token) :]
        return prompt

    def budget(prompt: str, requested: int | None, param: str) -> int:
        """max_tokens for this prompt: the request's, checked against the context, or all the room left."""
        prompt_tokens = len(tokenizer(prompt)["input_ids"])  # as the preprocessing model counts them
        if prompt_tokens > settings.max_input_len:
            raise APIError(
                ErrorKind.INVALID_INPUT,
                f"The prompt is {prompt_tokens} tokens; this model takes at most "
                f"{settings.max_input_len} input tokens.",
                param="messages" if param != "max_tokens" else "prompt",
                code="context_length_exceeded",
            )
        room = settings.max_seq_len - prompt_tokens
        if requested is None:
            return room
        if requested > room:
            raise APIError(
                ErrorKind.INVALID_INPUT,
                f"This model's maximum context length is {settings.max_seq_len} tokens; the prompt "
                f"({prompt_tokens} tokens) plus {param} ({requested}) is more.",
                param=param,
                code="context_length_exceeded",
            )
        return requested

    async def run(prompts: list[str], body: SamplingRequest, max_tokens: list[int]) -> list[Generation]:
        async def one(i: int) -> Generation:
            prompt_index, choice = divmod(i, body.n)
            text, last = [], None
            async for generation in generate(prompts[prompt_index], body, max_tokens[prompt_index], choice):
                text.append(generation.text)
                last = generation
            last.text = "".join(text)
            last.index = i
            return last

        return await gather_or_cancel(one(i) for i in range(len(prompts) * body.n))

    async def merged(prompts: list[str], body: SamplingRequest, max_tokens: list[int]) -> AsyncIterator[Generation]:
        """Deltas of every choice as they come, tagged with the choice index."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            prompt_index, choice = divmod(i, body.n)
            try:
                async for generation in generate(prompts[prompt_index], body, max_tokens[prompt_index], choice):
                    generation.index = i
                    await queue.put(generation)
            except Exception as exc:
                await queue.put(exc)
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(i)) for i in range(len(prompts) * body.n)]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    def usage(generations: list[Generation], n: int) -> dict:
        prompt = sum(g.prompt_tokens for g in generations if g.index % n == 0)  # each prompt once, not per choice
        completion = sum(g.completion_tokens for g in generations)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def sse(events: AsyncIterator[dict]) -> StreamingResponse:
        async def body():
            try:
                async for event in events:
                    yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
            except APIError as exc:
                yield f"data: {json.dumps(exc.body(), ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        check_model(body.model)
        body.check_supported()
        prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
        if not prompts or not all(prompts):
            raise APIError(
                ErrorKind.INVALID_INPUT,
                "'prompt' must be a non-empty string or list of non-empty strings",
                param="prompt",
            )
        limits = [budget(p, body.max_tokens, "max_tokens") for p in prompts]
        request_id, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": request_id, "object": "text_completion", "created": now, "model": settings.model_name}
        if not body.stream:
            generations = await run(prompts, body, limits)
            choices = [
                {"index": g.index, "text": g.text, "logprobs": None, "finish_reason": g.finish_reason}
                for g in generations
            ]
            return {**base, "choices": choices, "usage": usage(generations, body.n)}

        generations = await started(merged(prompts, body, limits))

        async def events():
            finals = []
            async for g in generations:
                if g.finish_reason:
                    finals.append(g)
                if g.text or g.finish_reason:
                    choice = {"index": g.index, "text": g.text, "logprobs": None, "finish_reason": g.finish_reason}
                    yield {**base, "choices": [choice]}
            if body.stream_options and body.stream_options.include_usage:
                yield {**base, "choices": [], "usage": usage(finals, body.n)}

        return sse(events())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        check_model(body.model)
        body.check_supported()
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = chat_prompt(messages)
        except Exception as exc:
            raise APIError(
                ErrorKind.INVALID_INPUT, f"the messages do not fit the model's chat template: {exc}", param="messages"
            ) from None
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        limit = budget(prompt, body.max_completion_tokens or body.max_tokens, param)
        request_id, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": request_id, "object": "chat.completion", "created": now, "model": settings.model_name}
        if not body.stream:
            generations = await run([prompt], body, [limit])
            choices = [
                {
                    "index": g.index,
                    "message": {"role": "assistant", "content": g.text},
                    "logprobs": None,
                    "finish_reason": g.finish_reason,
                }
                for g in generations
            ]
            return {**base, "choices": choices, "usage": usage(generations, body.n)}
        base["object"] = "chat.completion.chunk"
        generations = await started(merged([prompt], body, [limit]))

        async def events():
            for i in range(body.n):
                yield {
                    **base,
                    "choices": [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            finals = []
            async for g in generations:
                if g.finish_reason:
                    finals.append(g)
                if g.text:
                    yield {
                        **base,
                        "choices": [
                            {"index": g.index, "delta": {"content": g.text}, "logprobs": None, "finish_reason": None}
                        ],
                    }
                if g.finish_reason:
                    yield {
                        **base,
                        "choices": [
                            {"index": g.index, "delta": {}, "logprobs": None, "finish_reason": g.finish_reason}
                        ],
                    }
            if body.stream_options and body.stream_options.include_usage:
                yield {**base, "choices": [], "usage": usage(finals, body.n)}

        return sse(events())

    return app


def error_kind(error: InferenceServerException) -> ErrorKind:
    """The kind of a Triton error: its tag (our models'), else Triton's own known text, else its status code.

    The tag and the text come first because inside a gRPC stream an error has no status code, and
    because one code covers several kinds (UNAVAILABLE: a full queue, or a server not reachable).
    """
    message = error.message() or str(error)
    kind = ErrorKind.of_message(message)
    if kind is not None:
        return kind
    for text, kind in TRITON_MESSAGES:
        if text in message:
            return kind
    return TRITON_STATUSES.get(str(error.status() or ""), ErrorKind.INTERNAL)


def triton_error(error: InferenceServerException) -> APIError:
    """Triton's error as OpenAI's, with its kind's status: a client's mistake is never a 500."""
    kind = error_kind(error)
    message = error.message() or str(error)
    if kind is ErrorKind.BUSY:
        return APIError(kind, message, code="server_busy")
    if kind is ErrorKind.UNAVAILABLE:
        return APIError(kind, f"the Triton server is not available: {message}")
    return APIError(kind, message)


async def gather_or_cancel(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """All results in order; the first failure cancels the others, so a failed choice leaves no sibling generating.

    Returns (or raises) once the cancelled ones have finished, i.e. have cancelled their Triton requests.
    """
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def started(items: AsyncIterator[T]) -> AsyncIterator[T]:
    """`items` with its first item already awaited.

    A streamed answer awaits its first output before the response starts, so a request refused before
    any output (most client mistakes are found then) answers with its error's status, not a 200 stream.
    """
    first = await anext(items)

    async def chained() -> AsyncIterator[T]:
        yield first
        async for item in items:
            yield item

    return chained()


def main(argv: list[str] | None = None) -> int:
    import os
    from pathlib import Path

    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grpc-url", default="127.0.0.1:8001", help="the Triton server's gRPC address")
    parser.add_argument("--manifest", type=Path, help="build/manifest.json: gives the three options below")
    parser.add_argument("--tokenizer-dir")
    parser.add_argument("--max-seq-len", type=int, default=4096, help="prompt + generated tokens")
    parser.add_argument("--max-input-len", type=int, default=3072, help="prompt tokens the model takes")
    parser.add_argument("--model-name", help="the name clients use (default: the tokenizer folder's name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("TRITONLLM_API_KEY"),
        help="require `Authorization: Bearer KEY` (default: $TRITONLLM_API_KEY; none: open)",
    )
    args = parser.parse_args(argv)
    if args.manifest:
        manifest = json.loads(args.manifest.read_text())
        args.tokenizer_dir = manifest["tokenizer_dir"]
        args.max_input_len, args.max_seq_len = manifest["max_input_len"], manifest["max_seq_len"]
    if not args.tokenizer_dir:
        parser.error("give --manifest or --tokenizer-dir")
    settings = Settings(
        args.grpc_url,
        args.tokenizer_dir,
        args.model_name or Path(args.tokenizer_dir).name,
        args.max_input_len,
        args.max_seq_len,
        args.api_key or None,
    )
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
