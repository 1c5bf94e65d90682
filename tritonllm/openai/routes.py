"""The OpenAI endpoints as plain functions of a Generator and a request body; the app (app.py) wires them."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from tritonllm.errors import ErrorKind
from tritonllm.openai.chat_models import ChatRequest
from tritonllm.openai.generation import Generator, Prompt, started
from tritonllm.openai.models import (
    APIError,
    CompletionRequest,
    Generation,
    SamplingRequest,
    invalid,
)
from tritonllm.openai.tools import HermesStream, parse_call, parse_hermes, tool_call

CREATED = int(time.time())  # the model card's creation time: when this layer started
MAX_CHOICES = 128  # of one completions request: its prompts times n, each a stream of its own


def model_cards(generator: Generator) -> list[dict]:
    """The base model's card, then each LoRA adapter's, whose `parent` is the base (vLLM's cards)."""
    base = generator.settings.model_name
    return [
        {"id": name, "object": "model", "created": CREATED, "owned_by": "tritonllm", "parent": parent}
        for name, parent in [(base, None), *((adapter, base) for adapter in generator.adapters.names)]
    ]


async def check_model(generator: Generator, name: str) -> None:
    if await generator.adapters.check(generator.client, name) is None:
        served = ", ".join(f"`{card['id']}`" for card in model_cards(generator))
        raise APIError(
            ErrorKind.NOT_FOUND,
            f"The model `{name}` does not exist; this server serves {served}",
            param="model",
            code="model_not_found",
        )


def usage(generations: list[Generation], n: int) -> dict:
    firsts = [g for g in generations if g.index % n == 0]  # each prompt once, not per choice
    prompt = sum(g.prompt_tokens for g in firsts)
    completion = sum(g.completion_tokens for g in generations)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(g.cached_tokens for g in firsts)},
    }


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


def check_min_tokens(body: SamplingRequest, prompts: list[Prompt]) -> None:
    limit = min(p.max_tokens for p in prompts)
    if body.min_tokens > limit:
        raise invalid("min_tokens", f"is {body.min_tokens}, more than the {limit} tokens max_tokens allows")


async def completions(generator: Generator, body: CompletionRequest):
    await check_model(generator, body.model)
    body.check_supported(generator.vocab_size, generator.settings.engine_additions)
    prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
    if not prompts or not all(prompts):
        raise invalid("prompt", "must be a non-empty string or list of non-empty strings")
    if len(prompts) * body.n > MAX_CHOICES:
        raise invalid("prompt", f"{len(prompts)} prompts of n={body.n} choices each are over the {MAX_CHOICES} choices")
    # Tokenizing takes milliseconds per prompt (seconds for a long list): on a thread, never the event loop's.
    budgets = await asyncio.to_thread(
        lambda: [generator.budget(p, body.max_tokens, "max_tokens", "prompt") for p in prompts]
    )
    check_min_tokens(body, budgets)
    texts = generator.token_texts
    echoes = [p if body.echo else "" for p in prompts]  # choice i echoes prompt i // n
    model = body.model
    base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model}

    def choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    if not body.stream:
        generations = await generator.run(budgets, body)
        choices = []
        for g in generations:
            echo = echoes[g.index // body.n]
            logprobs = texts.completion(g, len(echo))[0] if body.logprobs is not None else None
            choices.append(choice(g.index, echo + g.text, logprobs, g.finish_reason))
        return {**base, "choices": choices, "usage": usage(generations, body.n)}

    generations = await started(generator.merged(budgets, body))

    async def events():
        offsets = {}
        for i in range(len(prompts) * body.n):
            offsets[i] = len(echoes[i // body.n])
            if body.echo:
                yield {**base, "choices": [choice(i, echoes[i // body.n], None, None)]}
        finals = []
        async for g in generations:
            if g.finish_reason:
                finals.append(g)
            logprobs = None
            if body.logprobs is not None and g.tokens:
                logprobs, offsets[g.index] = texts.completion(g, offsets[g.index])
            if g.text or logprobs or g.finish_reason:
                yield {**base, "choices": [choice(g.index, g.text, logprobs, g.finish_reason)]}
        if body.stream_options and body.stream_options.include_usage:
            yield {**base, "choices": [], "usage": usage(finals, body.n)}

    return sse(events())


def answer(body: ChatRequest, g: Generation) -> tuple[dict, str | None]:
    """A whole choice's message and finish reason, with the tool calls its text holds."""
    mode, names = body.tool_mode(), {t.function.name for t in body.tools or []}
    message: dict = {"role": "assistant", "content": g.text}
    if mode == "named":  # the grammar made the text the arguments; only max_tokens can cut them short
        message.update(content=None, tool_calls=[tool_call(body.tool_choice.function.name, g.text)])
        return message, "tool_calls" if g.finish_reason != "length" else "length"
    if mode == "required":
        call = parse_call(g.text, names)
        if call is not None:
            message.update(content=None, tool_calls=[call])
            return message, "tool_calls"
    if mode == "auto":
        content, calls = parse_hermes(g.text, names)
        if calls:
            message.update(content=content, tool_calls=calls if body.parallel_tool_calls is not False else calls[:1])
            return message, "tool_calls"
    return message, g.finish_reason


class ChatStream:
    """One streamed choice's deltas: content as it comes, or tool calls. A named function's arguments are
    streamed as generated; a required call, and the calls of "auto", are sent whole once parsed."""

    def __init__(self, body: ChatRequest) -> None:
        self.body, self.mode = body, body.tool_mode()
        self.names = {t.function.name for t in body.tools or []}
        self.text = ""
        self.hermes = HermesStream(self.names)

    def start(self) -> list[dict]:
        """The deltas before any text: the role, and a named function's call."""
        deltas: list[dict] = [{"role": "assistant", "content": ""}]
        if self.mode == "named":
            call = tool_call(self.body.tool_choice.function.name, "")
            deltas.append({"tool_calls": [{"index": 0, **call}]})
        return deltas

    def delta(self, text: str) -> dict:
        if self.mode == "named":
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
        if self.mode == "required":
            self.text += text
            return {}
        if self.mode == "auto":
            text = self.hermes.feed(text)
        return {"content": text} if text else {}

    def end(self, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """The deltas held until the end, and the finish reason."""
        if self.mode == "named":
            return [], "tool_calls" if finish_reason != "length" else "length"
        if self.mode == "required":
            call = parse_call(self.text, self.names)
            if call is None:
                return [{"content": self.text}] if self.text else [], finish_reason
            return [{"tool_calls": [{"index": 0, **call}]}], "tool_calls"
        if self.mode == "auto":
            content, calls = self.hermes.finish()
            if self.body.parallel_tool_calls is False:
                calls = calls[:1]
            deltas = [{"content": content}] if content else []
            deltas += [{"tool_calls": [{"index": j, **call}]} for j, call in enumerate(calls)]
            return deltas, "tool_calls" if calls else finish_reason
        return [], finish_reason


def chat_budget(generator: Generator, body: ChatRequest) -> Prompt:
    """The conversation through the chat template, tokenized and checked against the context."""
    messages = [m.rendered() for m in body.messages]
    try:
        prompt = generator.chat_prompt(messages, body.offered_tools())
    except APIError:
        raise
    except Exception as exc:
        raise invalid("messages", f"the messages do not fit the model's chat template: {exc}") from None
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    return generator.budget(prompt, body.max_completion_tokens or body.max_tokens, param, "messages")


async def chat_completions(generator: Generator, body: ChatRequest):
    await check_model(generator, body.model)
    body.check_supported(generator.vocab_size, generator.settings.engine_additions)
    budget = await asyncio.to_thread(chat_budget, generator, body)  # the template and the tokenizer: off the loop
    check_min_tokens(body, [budget])
    texts = generator.token_texts
    model = body.model
    base = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
    }
    if not body.stream:
        generations = await generator.run([budget], body)
        choices = []
        for g in generations:
            message, finish_reason = answer(body, g)
            logprobs = texts.chat(g) if body.logprobs else None
            choices.append({"index": g.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason})
        return {**base, "choices": choices, "usage": usage(generations, body.n)}
    base["object"] = "chat.completion.chunk"
    generations = await started(generator.merged([budget], body))

    def chunk(index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**base, "choices": [choice]}

    async def events():
        streams = [ChatStream(body) for _ in range(body.n)]
        for i, stream in enumerate(streams):
            for delta in stream.start():
                yield chunk(i, delta)
        finals = []
        async for g in generations:
            stream = streams[g.index]
            delta = stream.delta(g.text)
            logprobs = texts.chat(g) if body.logprobs and g.tokens else None
            if delta or logprobs:
                yield chunk(g.index, delta, logprobs)
            if g.finish_reason:
                finals.append(g)
                deltas, finish_reason = stream.end(g.finish_reason)
                for delta in deltas:
                    yield chunk(g.index, delta)
                yield chunk(g.index, {}, finish_reason=finish_reason)
        if body.stream_options and body.stream_options.include_usage:
            yield {**base, "choices": [], "usage": usage(finals, body.n)}

    return sse(events())
