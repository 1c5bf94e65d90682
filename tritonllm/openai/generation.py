"""Generation through Triton for the OpenAI layer: one gRPC stream per choice, to the engine model with the
per-request pipeline run here (engine_stream.py) when the layer has the repository and the engine streams, else to
`tensorrt_llm_bls`, which runs the same pipeline inside Triton.

No model is loaded here, only the tokenizer: for the chat template, to count a prompt's tokens as the
preprocessing model does, to write log probabilities' tokens as text, and for the pipeline.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterable
from pathlib import Path
from typing import NamedTuple, TypeVar

import grpc
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from tritonllm.errors import ErrorKind
from tritonllm.openai.engine_stream import EngineStreams
from tritonllm.openai.errors import triton_error
from tritonllm.openai.logprobs import TokenTexts
from tritonllm.openai.lora_admin import ServedAdapters
from tritonllm.openai.models import (
    FINISH_REASONS,
    USAGE_PERF_OUTPUT,
    APIError,
    Generation,
    SamplingRequest,
)
from tritonllm.openai.settings import Settings
from tritonllm.openai.tools import hermes_messages, template_renders_tools
from tritonllm.protocol import infer_inputs, request_tensors
from tritonllm.text.pipeline import Parts, streaming_parameters
from tritonllm.text.tokenization import MAX_BYTES_PER_TOKEN
from tritonllm.text.tokenizer import load_tokenizer

T = TypeVar("T")


class Prompt(NamedTuple):
    """A prompt and its max_tokens, checked against the context. `ids`: its tokens as the preprocessing step makes
    them, counted once and handed to the direct path's pipeline (None when choices go through tensorrt_llm_bls)."""

    text: str
    max_tokens: int
    ids: list[int] | None = None


class Generator:
    """The served model as the routes see it: prompts in, choices out (whole, or as deltas)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.direct: EngineStreams | None = None
        if settings.repository:
            repository = Path(settings.repository)
            ensemble, engine_model, skip_special_tokens = streaming_parameters(repository)
            parts = Parts.load(repository, ensemble, skip_special_tokens)
            self.direct = EngineStreams(parts, engine_model, repository, settings.grpc_url)
            tokenizer = self.direct.parts.preprocessor.tokenizer  # the preprocessing model's, loaded once
        else:
            tokenizer = load_tokenizer(settings.tokenizer_dir, settings.tokenizer_class)
        self.tokenizer = tokenizer
        bos = tokenizer.bos_token_id
        self._adds_bos = bool(bos is not None and tokenizer("x")["input_ids"][:1] == [bos])
        self.vocab_size = len(tokenizer)
        self.token_texts = TokenTexts(tokenizer)
        self._client: grpcaio.InferenceServerClient | None = None
        self.adapters = ServedAdapters(settings, self.direct.engine_model if self.direct is not None else None)

    @property
    def client(self) -> grpcaio.InferenceServerClient:
        if self._client is None:  # created inside the server's event loop
            self._client = grpcaio.InferenceServerClient(self.settings.grpc_url)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def ready(self) -> bool:
        try:
            return await self.client.is_server_ready()
        except InferenceServerException as exc:
            raise triton_error(exc) from None

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The conversation through the chat template; tools, tool calls and tool results through the
        template's own tool support when it has one, else written in the Hermes format (tools.py)."""
        tokenizer = self.tokenizer
        if template_renders_tools(tokenizer.chat_template):
            prompt = tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False, add_generation_prompt=True
            )
        else:
            prompt = tokenizer.apply_chat_template(
                hermes_messages(messages, tools or []), tokenize=False, add_generation_prompt=True
            )
        # Preprocessing adds the tokenizer's special tokens: a template that writes BOS itself would double it.
        if self._adds_bos and prompt.startswith(tokenizer.bos_token):
            prompt = prompt[len(tokenizer.bos_token) :]
        return prompt

    def budget(self, prompt: str, requested: int | None, param: str, prompt_param: str) -> Prompt:
        """The prompt with its max_tokens: the request's (the body's `param`), checked against the context, or all
        the room left; an over-long prompt is refused naming `prompt_param` (completions' `prompt`, chat's
        `messages`)."""
        settings = self.settings
        limit = MAX_BYTES_PER_TOKEN * settings.max_input_len  # the preprocessing step's, checked before tokenizing
        if len(prompt) > limit and len(prompt.encode()) > limit:
            raise APIError(
                ErrorKind.INVALID_INPUT,
                f"The prompt is {len(prompt.encode())} bytes; this model takes at most {limit} "
                f"({settings.max_input_len} input tokens).",
                param=prompt_param,
                code="context_length_exceeded",
            )
        # As the preprocessing step counts them; on the direct path its pipeline takes these ids as they are.
        if self.direct is not None:
            ids = self.direct.parts.preprocessor.tokenize_prompt(prompt)
        else:
            ids = self.tokenizer(prompt)["input_ids"]
        prompt_tokens = len(ids)
        if prompt_tokens > settings.max_input_len:
            raise APIError(
                ErrorKind.INVALID_INPUT,
                f"The prompt is {prompt_tokens} tokens; this model takes at most "
                f"{settings.max_input_len} input tokens.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        room = settings.max_seq_len - prompt_tokens
        if requested is not None and requested > room:
            raise APIError(
                ErrorKind.INVALID_INPUT,
                f"This model's maximum context length is {settings.max_seq_len} tokens; the prompt "
                f"({prompt_tokens} tokens) plus {param} ({requested}) is more.",
                param=param,
                code="context_length_exceeded",
            )
        return Prompt(prompt, room if requested is None else requested, ids if self.direct is not None else None)

    async def generate(self, prompt: Prompt, body: SamplingRequest, index: int) -> AsyncIterator[Generation]:
        """Stream one choice from Triton: deltas (finish_reason None), then a final Generation."""
        tensors = request_tensors(
            prompt.text,
            prompt.max_tokens,
            **body.inputs(index, self.vocab_size, self.settings.engine_additions),
            lora_name=self.adapters.of(body.model) or None,  # the routes checked it
        )
        if self.direct is not None:
            pipeline = self.direct.request({name: value for name, value, _ in tensors}, prompt.ids)
            try:
                async for outputs in self.direct.stream(self.client, pipeline):
                    yield response(Arrays(outputs), index, self.settings.kv_cache_block_tokens)
            except grpc.RpcError as exc:
                raise triton_error(InferenceServerException(msg=exc.details(), status=str(exc.code()))) from None
            return
        inputs = infer_inputs(grpcclient, tensors)

        async def requests():
            yield {"model_name": self.settings.triton_model, "inputs": inputs, "request_id": uuid.uuid4().hex}

        responses = self.client.stream_infer(requests())
        finished = False
        try:
            async for result, error in responses:
                if error is not None:
                    finished = True  # an error ends the request
                    raise triton_error(error)
                generation = response(result, index, self.settings.kv_cache_block_tokens)
                if generation.finish_reason is not None:
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

    async def run(self, prompts: list[Prompt], body: SamplingRequest) -> list[Generation]:
        """Every choice of every prompt, whole; choice i is prompt i // n."""

        async def one(i: int) -> Generation:
            prompt_index, choice = divmod(i, body.n)
            whole = Generation(i)
            async for generation in self.generate(prompts[prompt_index], body, choice):
                whole.extend(generation)
            return whole

        return await gather_or_cancel(one(i) for i in range(len(prompts) * body.n))

    async def merged(self, prompts: list[Prompt], body: SamplingRequest) -> AsyncIterator[Generation]:
        """Deltas of every choice as they come, tagged with the choice index."""
        if len(prompts) * body.n == 1:  # one choice: its own stream, without a task and a queue per delta
            async for generation in self.generate(prompts[0], body, 0):
                yield generation
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            prompt_index, choice = divmod(i, body.n)
            try:
                async for generation in self.generate(prompts[prompt_index], body, choice):
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


def response(result, index: int, block_tokens: int = 1) -> Generation:
    """One streamed response of tensorrt_llm_bls as a delta of choice `index`; the last one (with a
    finish_reason) also says why it ended, how many tokens went in and out, and how many of the prompt's
    came from the prefix cache (reused KV cache blocks of `block_tokens`). Shapes are read
    defensively: only the element counts are relied on."""
    generation = Generation(index, output_scalar(result, "text_output", b"").decode())
    ids = result.as_numpy("output_ids")
    if ids is not None:
        generation.tokens = ids.reshape(-1).tolist()
        log_probs = result.as_numpy("output_log_probs")
        generation.log_probs = log_probs.reshape(-1).tolist() if log_probs is not None else []
        top, top_ids = result.as_numpy("top_log_probs"), result.as_numpy("top_log_prob_ids")
        count = len(generation.tokens)
        if top is not None and top_ids is not None and count and top.size:
            top, top_ids = top.reshape(count, -1).tolist(), top_ids.reshape(count, -1).tolist()
            generation.top = [list(zip(ids_, lps, strict=True)) for ids_, lps in zip(top_ids, top, strict=True)]
    reason = output_scalar(result, "finish_reason")
    if reason is not None:
        generation.finish_reason = FINISH_REASONS.get(reason.decode(), "stop")
        generation.prompt_tokens = int(output_scalar(result, "num_input_tokens", 0))
        generation.completion_tokens = int(output_scalar(result, "num_output_tokens", 0))
        reused = int(output_scalar(result, USAGE_PERF_OUTPUT, 0)) * block_tokens
        generation.cached_tokens = min(reused, generation.prompt_tokens)
    return generation


class Arrays(dict):
    """Tensors by name, read as a tritonclient result is (`as_numpy`)."""

    def as_numpy(self, name: str):
        return self.get(name)


def output_scalar(result, name: str, default=None):
    value = result.as_numpy(name)
    return value.reshape(-1)[0] if value is not None and value.size else default


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
