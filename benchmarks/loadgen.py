"""A small asynchronous load generator with token-level metrics, for `make perf` and `make bench`.

genai-perf (run by `make perf`) measures the streaming model; this module measures what it
cannot: the request/response `ensemble` and the engine alone fed the same token ids (the
baseline of the pipeline-overhead ratio), with the same time to first token (TTFT),
inter-token latency (ITL) and output tokens/s, so all targets are compared by one method.

Targets:
- `stream`: `tensorrt_llm_bls` over gRPC bidirectional streaming (TTFT and ITL are measured);
- `sse`: `tensorrt_llm_bls` over HTTP generate_stream (server-sent events);
- `openai_chat`: the OpenAI layer's streamed /v1/chat/completions;
- `ensemble`: text in, text out over HTTP /infer; `ensemble_grpc`: the same over gRPC;
- `engine`: the engine alone (`tensorrt_llm`, its request/response face) over HTTP /infer, with the token ids the
  ensemble's preprocessing would produce: the baseline for the ensemble's overhead;
- `engine_stream` / `engine_whole`: the engine model itself (`tensorrt_llm`) over gRPC streaming, a
  response per token or one per request, with the same token ids.
Every request asks for exactly `max_tokens` tokens (`end_id` -1), so all targets do the same work.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tritonllm.protocol import DECOUPLED_ENGINE_MODEL, ENGINE_MODEL, infer_inputs

PROMPTS = Path(__file__).resolve().parent / "prompts.json"


@dataclass
class Record:
    start: float
    end: float
    first_token: float | None  # streaming only
    output_tokens: int
    error: str | None = None
    responses: int = 0  # responses that carried tokens (counted by the engine model's own targets)


@dataclass
class LevelResult:
    target: str
    concurrency: int
    requests: int
    errors: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_mean_ms: float | None
    itl_p50_ms: float | None


def load_prompts(path: Path = PROMPTS) -> list[str]:
    return json.loads(path.read_text())["prompts"]


def summarize(target: str, concurrency: int, records: Sequence[Record], duration: float | None = None) -> LevelResult:
    """Rates over `duration` seconds, by default the span of the records' successful requests; records of
    several separate runs pass the sum of their runs' spans, so time between the runs does not count."""
    good = [r for r in records if r.error is None]
    if not good:
        raise RuntimeError(f"{target} at concurrency {concurrency}: every request failed: {records[0].error}")
    duration = span(good) if duration is None else duration
    ttft, itl, latency = token_latencies(good)
    return LevelResult(
        target=target,
        concurrency=concurrency,
        requests=len(good),
        errors=len(records) - len(good),
        duration_s=round(duration, 3),
        requests_per_s=round(len(good) / duration, 3),
        output_tokens_per_s=round(sum(r.output_tokens for r in good) / duration, 2),
        latency_p50_ms=round(float(np.percentile(latency, 50)), 1),
        latency_p99_ms=round(float(np.percentile(latency, 99)), 1),
        ttft_p50_ms=round(float(np.percentile(ttft, 50)), 1) if ttft else None,
        ttft_p99_ms=round(float(np.percentile(ttft, 99)), 1) if ttft else None,
        itl_mean_ms=round(float(np.mean(itl)), 2) if itl else None,
        itl_p50_ms=round(float(np.percentile(itl, 50)), 2) if itl else None,
    )


def token_latencies(records: Sequence[Record]) -> tuple[list[float], list[float], list[float]]:
    """In ms: each streamed request's time to first token and mean time between its tokens after the first, and
    every request's latency."""
    ttft = [(r.first_token - r.start) * 1000 for r in records if r.first_token is not None]
    itl = [
        (r.end - r.first_token) * 1000 / (r.output_tokens - 1)
        for r in records
        if r.first_token is not None and r.output_tokens > 1
    ]
    return ttft, itl, [(r.end - r.start) * 1000 for r in records]


def span(records: Sequence[Record]) -> float:
    """Seconds from the first start to the last end of the successful ones among `records` (0 when none)."""
    good = [r for r in records if r.error is None]
    return max(r.end for r in good) - min(r.start for r in good) if good else 0.0


async def run_level(send: Callable[[int], Awaitable[Record]], concurrency: int, requests: int) -> list[Record]:
    """`requests` calls of `send(i)`, `concurrency` at a time (closed loop: each worker sends its next when done)."""
    counter = iter(range(requests))
    records: list[Record] = []

    async def worker() -> None:
        for i in counter:
            records.append(await send(i))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


def chat_token_ids(tokenizer, prompts: Sequence[str]) -> list[list[int]]:
    """What preprocessing makes of each prompt with apply_chat_template."""
    return [
        tokenizer(
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )["input_ids"]
        for p in prompts
    ]


class Targets:
    """Builds `send(i)` coroutines for each target, over one gRPC and one HTTP aio client."""

    def __init__(
        self,
        grpc_url: str,
        http_url: str,
        prompts: Sequence[str],
        max_tokens: int,
        tokenizer=None,
        variants: dict[str, dict] | None = None,
        *,
        token_ids: list[list[int]] | None = None,
        connections: int = 256,
        openai: tuple[str, str] | None = None,
        openai_body: dict | None = None,
        keep_alive: bool = True,
        engine_model: str = DECOUPLED_ENGINE_MODEL,
    ):
        """`token_ids`: chat_token_ids(tokenizer, prompts) when already made; `openai`: (base URL, model name);
        `openai_body`: fields added to every OpenAI request's body; `keep_alive` false: each OpenAI or
        server-sent-event request on a connection of its own (llama-server drops a connection after a streamed
        response without saying so, and the next request on it fails); `engine_model`: the build's decoupled
        engine model (manifest's engine_model), which the engine targets stream from."""
        import tritonclient.grpc.aio as grpcaio
        import tritonclient.http.aio as httpaio

        self.grpc = grpcaio.InferenceServerClient(grpc_url)
        self.http = httpaio.InferenceServerClient(http_url, conn_limit=connections, conn_timeout=600)
        self.http_url, self.openai, self.connections = http_url, openai, connections
        self.openai_body = dict(openai_body or {})
        self.keep_alive = keep_alive
        self.engine_model = engine_model
        self._session = None  # an aiohttp session for the server-sent-event targets, made on first use
        self.prompts = list(prompts)
        self.max_tokens = max_tokens
        self.variants = dict(variants or {})  # name -> extra request_tensors options, sent through `ensemble`
        self.token_ids = token_ids
        if tokenizer is not None and token_ids is None:
            self.token_ids = chat_token_ids(tokenizer, self.prompts)

    async def close(self) -> None:
        await self.grpc.close()
        await self.http.close()
        if self._session is not None:
            await self._session.close()

    def sender(self, name: str) -> Callable[[int], Awaitable[Record]]:
        """`send(i)` of a target method, or of `ensemble` with the options of variant `name`."""
        if name in self.variants:
            return lambda i: self.ensemble(i, self.variants[name])
        return getattr(self, name)

    def _text_tensors(self, i: int, module, stream: bool, options: dict | None = None) -> list:
        from tritonllm.protocol import request_tensors

        prompt = self.prompts[i % len(self.prompts)]
        tensors = request_tensors(prompt, self.max_tokens, return_num_output_tokens=True, **(options or {}))
        tensors.append(("end_id", np.array([[-1]], np.int32), "INT32"))
        if stream:
            tensors.append(("stream", np.array([[True]]), "BOOL"))
        return infer_inputs(module, tensors)

    async def stream(self, i: int) -> Record:
        import tritonclient.grpc as grpcclient

        inputs = self._text_tensors(i, grpcclient, stream=True)

        async def requests():
            yield {"model_name": "tensorrt_llm_bls", "inputs": inputs, "request_id": uuid.uuid4().hex}

        start = time.perf_counter()
        first = record = None
        # Read to the end of the stream (the server closes it after the final response): leaving early
        # would cancel the call right after its final response.
        async for result, error in self.grpc.stream_infer(requests()):
            if error is not None:
                record = Record(start, time.perf_counter(), None, 0, error.message())
                continue
            text = result.as_numpy("text_output")
            if first is None and text is not None and text.reshape(-1)[0]:
                first = time.perf_counter()
            tokens = result.as_numpy("num_output_tokens")
            if tokens is not None:
                record = Record(start, time.perf_counter(), first, int(tokens.reshape(-1)[0]))
        return record or Record(start, time.perf_counter(), first, 0, "the stream ended without a final response")

    async def ensemble(self, i: int, options: dict | None = None) -> Record:
        import tritonclient.http as httpclient

        start = time.perf_counter()
        try:
            result = await self.http.infer("ensemble", self._text_tensors(i, httpclient, False, options))
        except Exception as exc:
            return Record(start, time.perf_counter(), None, 0, str(exc))
        return Record(start, time.perf_counter(), None, int(result.as_numpy("num_output_tokens").reshape(-1)[0]))

    def _token_tensors(self, i: int) -> list[tuple]:
        ids = self.token_ids[i % len(self.token_ids)]
        return [
            ("input_ids", np.array([ids], np.int32), "INT32"),
            ("input_lengths", np.array([[len(ids)]], np.int32), "INT32"),
            ("request_output_len", np.array([[self.max_tokens]], np.int32), "INT32"),
        ]

    async def ensemble_grpc(self, i: int) -> Record:
        import tritonclient.grpc as grpcclient

        start = time.perf_counter()
        try:
            result = await self.grpc.infer("ensemble", self._text_tensors(i, grpcclient, False))
        except Exception as exc:
            return Record(start, time.perf_counter(), None, 0, str(exc))
        return Record(start, time.perf_counter(), None, int(result.as_numpy("num_output_tokens").reshape(-1)[0]))

    @contextlib.asynccontextmanager
    async def _post(self, url: str, body: dict):
        """A JSON POST on the targets' aiohttp session (made at the first one); its response, once it is a 200."""
        import aiohttp

        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self.connections, force_close=not self.keep_alive)
            self._session = aiohttp.ClientSession(connector=connector)
        async with self._session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=600)) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
            yield response

    async def _events(self, url: str, body: dict):
        """The JSON payloads of a server-sent-event response, as they arrive."""
        async with self._post(url, body) as response:
            async for line in response.content:
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    yield json.loads(line[5:])

    async def _timed_events(self, url: str, body: dict, first_text, output_tokens) -> Record:
        """A streamed request: first is the first payload with text, the count from the one that has it."""
        start = time.perf_counter()
        first, tokens = None, None
        try:
            async for event in self._events(url, body):
                if first is None and first_text(event):
                    first = time.perf_counter()
                tokens = output_tokens(event) or tokens
        except Exception as exc:
            return Record(start, time.perf_counter(), first, 0, str(exc))
        if tokens is None:
            return Record(start, time.perf_counter(), first, 0, "the stream ended without a token count")
        return Record(start, time.perf_counter(), first, tokens)

    async def sse(self, i: int) -> Record:
        """tensorrt_llm_bls over HTTP generate_stream."""
        body = {
            "text_input": self.prompts[i % len(self.prompts)],
            "max_tokens": self.max_tokens,
            "apply_chat_template": True,
            "end_id": -1,
            "stream": True,
            "return_num_output_tokens": True,
        }
        url = f"http://{self.http_url}/v2/models/tensorrt_llm_bls/generate_stream"
        return await self._timed_events(url, body, lambda e: e.get("text_output"), lambda e: e.get("num_output_tokens"))

    async def openai_chat(self, i: int) -> Record:
        """The OpenAI layer's streamed chat completion, with its usage chunk for the token count."""
        base, model = self.openai
        body = {
            "model": model,
            "messages": [{"role": "user", "content": self.prompts[i % len(self.prompts)]}],
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.openai_body,
        }

        def text(event: dict) -> bool:
            return any(choice.get("delta", {}).get("content") for choice in event.get("choices", ()))

        def usage(event: dict) -> int | None:
            return (event.get("usage") or {}).get("completion_tokens")

        return await self._timed_events(f"{base}/v1/chat/completions", body, text, usage)

    def _completion_body(self, i: int, stream: bool) -> dict:
        """A greedy /v1/completions of the raw prompt i, max_tokens long, as any OpenAI-compatible server takes it."""
        body = {
            "model": self.openai[1],
            "prompt": self.prompts[i % len(self.prompts)],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body | self.openai_body

    async def completion_text(self, i: int) -> str:
        """The whole text of `openai_completion`'s request i, asked without streaming."""
        async with self._post(f"{self.openai[0]}/v1/completions", self._completion_body(i, stream=False)) as response:
            return (await response.json())["choices"][0]["text"]

    async def openai_completion(self, i: int) -> Record:
        """A streamed /v1/completions of the raw prompt (the peers' benchmark); the token count from the usage
        chunk, or max_tokens when the stream ended for its length."""
        body = self._completion_body(i, stream=True)

        def count(event: dict) -> int | None:
            if usage := event.get("usage"):
                return usage.get("completion_tokens")
            ended = any(choice.get("finish_reason") == "length" for choice in event.get("choices", ()))
            return self.max_tokens if ended else None

        def text(event: dict) -> bool:
            return any(choice.get("text") for choice in event.get("choices", ()))

        return await self._timed_events(f"{self.openai[0]}/v1/completions", body, text, count)

    async def engine_whole(self, i: int) -> Record:
        """The engine model alone, one response per request (as the ensemble's bridge asks it)."""
        return await self._engine_grpc(i, streaming=False)

    async def engine_stream(self, i: int) -> Record:
        """The engine model alone, streaming the token ids the ensemble's preprocessing makes."""
        return await self._engine_grpc(i, streaming=True)

    async def _engine_grpc(self, i: int, streaming: bool) -> Record:
        import tritonclient.grpc as grpcclient

        inputs = infer_inputs(grpcclient, [*self._token_tensors(i), ("streaming", np.array([[streaming]]), "BOOL")])

        async def requests():
            yield {"model_name": self.engine_model, "inputs": inputs, "request_id": uuid.uuid4().hex}

        start = time.perf_counter()
        first, tokens, responses, error = None, 0, 0, None
        async for result, failed in self.grpc.stream_infer(requests()):
            if failed is not None:
                error = failed.message()
                continue
            length = result.as_numpy("sequence_length")
            if length is not None and int(length.reshape(-1)[0]) > 0:
                first = first or time.perf_counter()
                tokens += int(length.reshape(-1)[0])
                responses += 1
        return Record(start, time.perf_counter(), first, tokens, error, responses)

    async def engine(self, i: int) -> Record:
        import tritonclient.http as httpclient

        start = time.perf_counter()
        try:
            result = await self.http.infer(ENGINE_MODEL, infer_inputs(httpclient, self._token_tensors(i)))
        except Exception as exc:
            return Record(start, time.perf_counter(), None, 0, str(exc))
        return Record(start, time.perf_counter(), None, int(result.as_numpy("sequence_length").reshape(-1)[0]))


async def sweep(targets: Targets, names: Sequence[str], levels: Sequence[int], requests_per_level) -> list[LevelResult]:
    results = []
    for name in names:
        send = getattr(targets, name)
        await run_level(send, 1, 2)  # warm-up: first requests of a target pay one-time costs
        for concurrency in levels:
            records = await run_level(send, concurrency, requests_per_level(concurrency))
            results.append(summarize(name, concurrency, records))
            print(json.dumps(asdict(results[-1])), flush=True)
    return results
