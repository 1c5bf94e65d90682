"""The OpenAI endpoints as plain functions of a Generator and a request body; the app (app.py) wires them."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from tritonllm.errors import ErrorKind
from tritonllm.openai.generation import Generator, started
from tritonllm.openai.models import APIError, ChatRequest, CompletionRequest, Generation

CREATED = int(time.time())  # the model card's creation time: when this layer started


def model_card(generator: Generator) -> dict:
    return {"id": generator.settings.model_name, "object": "model", "created": CREATED, "owned_by": "tritonllm"}


def check_model(generator: Generator, name: str) -> None:
    served = generator.settings.model_name
    if name != served:
        raise APIError(
            ErrorKind.NOT_FOUND,
            f"The model `{name}` does not exist; this server serves `{served}`",
            param="model",
            code="model_not_found",
        )


def usage(generations: list[Generation], n: int) -> dict:
    prompt = sum(g.prompt_tokens for g in generations if g.index % n == 0)  # each prompt once, not per choice
    completion = sum(g.completion_tokens for g in generations)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(events: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events ending in `data: [DONE]`; an error after the first event is sent as an event."""

    async def body():
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except APIError as exc:
            yield f"data: {json.dumps(exc.body(), ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def completions(generator: Generator, body: CompletionRequest):
    check_model(generator, body.model)
    body.check_supported()
    prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
    if not prompts or not all(prompts):
        raise APIError(
            ErrorKind.INVALID_INPUT, "'prompt' must be a non-empty string or list of non-empty strings", param="prompt"
        )
    limits = [generator.budget(p, body.max_tokens, "max_tokens") for p in prompts]
    model = generator.settings.model_name
    base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model}
    if not body.stream:
        generations = await generator.run(prompts, body, limits)
        choices = [
            {"index": g.index, "text": g.text, "logprobs": None, "finish_reason": g.finish_reason} for g in generations
        ]
        return {**base, "choices": choices, "usage": usage(generations, body.n)}

    generations = await started(generator.merged(prompts, body, limits))

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


async def chat_completions(generator: Generator, body: ChatRequest):
    check_model(generator, body.model)
    body.check_supported()
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    try:
        prompt = generator.chat_prompt(messages)
    except Exception as exc:
        raise APIError(
            ErrorKind.INVALID_INPUT, f"the messages do not fit the model's chat template: {exc}", param="messages"
        ) from None
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    limit = generator.budget(prompt, body.max_completion_tokens or body.max_tokens, param)
    model = generator.settings.model_name
    base = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
    }
    if not body.stream:
        generations = await generator.run([prompt], body, [limit])
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
    generations = await started(generator.merged([prompt], body, [limit]))

    def chunk(index: int, delta: dict, finish_reason: str | None = None) -> dict:
        return {**base, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

    async def events():
        for i in range(body.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        finals = []
        async for g in generations:
            if g.finish_reason:
                finals.append(g)
            if g.text:
                yield chunk(g.index, {"content": g.text})
            if g.finish_reason:
                yield chunk(g.index, {}, g.finish_reason)
        if body.stream_options and body.stream_options.include_usage:
            yield {**base, "choices": [], "usage": usage(finals, body.n)}

    return sse(events())
