"""Generation through Triton for the OpenAI layer: one gRPC stream to `tensorrt_llm_bls` per choice.

No model is loaded here, only the tokenizer: for the chat template, and to count a prompt's tokens as
the preprocessing model does.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import TypeVar

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from tritonllm.errors import ErrorKind
from tritonllm.openai.errors import triton_error
from tritonllm.openai.models import FINISH_REASONS, APIError, Generation, SamplingRequest, Settings
from tritonllm.protocol import infer_inputs, request_tensors

T = TypeVar("T")


class Generator:
    """The served model as the routes see it: prompts in, choices out (whole, or as deltas)."""

    def __init__(self, settings: Settings) -> None:
        from transformers import AutoTokenizer

        self.settings = settings
        self.tokenizer = tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_dir)
        bos = tokenizer.bos_token_id
        self._adds_bos = bool(bos is not None and tokenizer("x")["input_ids"][:1] == [bos])
        self._client: grpcaio.InferenceServerClient | None = None

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

    def chat_prompt(self, messages: list[dict]) -> str:
        tokenizer = self.tokenizer
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # Preprocessing adds the tokenizer's special tokens: a template that writes BOS itself would double it.
        if self._adds_bos and prompt.startswith(tokenizer.bos_token):
            prompt = prompt[len(tokenizer.bos_token) :]
        return prompt

    def budget(self, prompt: str, requested: int | None, param: str) -> int:
        """max_tokens for this prompt: the request's, checked against the context, or all the room left."""
        settings = self.settings
        prompt_tokens = len(self.tokenizer(prompt)["input_ids"])  # as the preprocessing model counts them
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

    async def generate(
        self, prompt: str, body: SamplingRequest, max_tokens: int, index: int
    ) -> AsyncIterator[Generation]:
        """Stream one choice from Triton: deltas (finish_reason None), then a final Generation."""
        seed = None if body.seed is None else (body.seed + index) % 2**64
        tensors = request_tensors(
            prompt, max_tokens, temperature=body.temperature, top_p=body.top_p, seed=seed, stop=body.stops(), chat=False
        )
        tensors.append(("stream", np.array([[True]]), "BOOL"))
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

    async def run(self, prompts: list[str], body: SamplingRequest, max_tokens: list[int]) -> list[Generation]:
        """Every choice of every prompt, whole; choice i is prompt i // n."""

        async def one(i: int) -> Generation:
            prompt_index, choice = divmod(i, body.n)
            text, last = [], None
            async for generation in self.generate(prompts[prompt_index], body, max_tokens[prompt_index], choice):
                text.append(generation.text)
                last = generation
            last.text = "".join(text)
            last.index = i
            return last

        return await gather_or_cancel(one(i) for i in range(len(prompts) * body.n))

    async def merged(
        self, prompts: list[str], body: SamplingRequest, max_tokens: list[int]
    ) -> AsyncIterator[Generation]:
        """Deltas of every choice as they come, tagged with the choice index."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            prompt_index, choice = divmod(i, body.n)
            try:
                async for generation in self.generate(prompts[prompt_index], body, max_tokens[prompt_index], choice):
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
