"""`tritonllm dynamo-worker`: this server as a worker of NVIDIA Dynamo, behind Dynamo's frontend and KV router.

The worker is a Dynamo backend (`dynamo.common.backend.LLMEngine`, Dynamo's unified backend path) registered with
token input: Dynamo's frontend serves the OpenAI API, applies the chat template, tokenizes, routes, and detokenizes;
each request reaches the built server's engine model as the OpenAI layer's direct path sends it (one gRPC stream per
request, tritonllm/openai/engine_stream.py), with the OpenAI layer's request rules (tritonllm/dynamo/requests.py).
The worker starts its own tritonserver on the build (or uses a running one, `--grpc-url`) and relays the llama.cpp
engine's prefix-cache events to Dynamo's KV router (tritonllm/dynamo/kv_relay.py). Dynamo's Worker owns the rest:
registration, discovery, cancellation (a request the frontend drops closes its stream here, which cancels it in
Triton), graceful shutdown.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import tritonclient.grpc.aio as grpcaio
from dynamo._core import Context
from dynamo.common.backend import EngineConfig, LLMEngine, LlmRegistration, WorkerConfig
from dynamo.common.backend.publisher import KvEventSource, PushSource
from dynamo.common.backend.worker import Worker
from dynamo.llm import exceptions

from tritonllm.dynamo.kv_relay import KvRelay
from tritonllm.dynamo.requests import chunk, completion_request, engine_arrays, final_chunk
from tritonllm.errors import ErrorKind
from tritonllm.launch.pytriton_wheel import ServerError
from tritonllm.launch.server_command import add_address_options
from tritonllm.launch.tritonserver import TritonServer
from tritonllm.openai.engine_stream import EngineStreams
from tritonllm.openai.logprobs import TokenTexts
from tritonllm.openai.models import APIError
from tritonllm.openai.settings import Settings
from tritonllm.protocol import KV_EVENT_BLOCK_TOKENS, KV_EVENTS_ENV
from tritonllm.text.pipeline import Parts, StreamedRequest, streaming_parameters

log = logging.getLogger(__name__)

# Our error kinds as Dynamo's exceptions, which its frontend turns into statuses (a client mistake: 400).
DYNAMO_ERRORS: dict[ErrorKind, type[Exception]] = {
    ErrorKind.INVALID_INPUT: exceptions.InvalidArgument,
    ErrorKind.TOO_LARGE: exceptions.InvalidArgument,
    ErrorKind.NOT_FOUND: exceptions.InvalidArgument,
    ErrorKind.UNAVAILABLE: exceptions.EngineShutdown,
}


def dynamo_error(exc: APIError) -> Exception:
    return DYNAMO_ERRORS.get(exc.kind, exceptions.Unknown)(str(exc))


class TritonWorkerEngine(LLMEngine):
    """One built server behind Dynamo: requests in as tokens, out as the engine model's tokens."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        build = Path(args.build_dir).resolve()
        self.manifest = json.loads((build / "manifest.json").read_text())
        repository = build / "model_repository"
        self.server: TritonServer | None = None
        self.kv_events = args.kv_events
        if args.grpc_url is None:
            self.server = TritonServer(
                repository, build / "tritonserver", args.http_port, args.grpc_port, args.metrics_port, args.host
            )
            if self.kv_events is None and self.manifest.get("engine_config", {}).get("prefix_cache"):
                self._events_dir = tempfile.TemporaryDirectory(prefix="tritonllm-kv-")
                self.kv_events = f"ipc://{self._events_dir.name}/events"
        grpc_url = args.grpc_url or f"{args.host}:{args.grpc_port}"
        self.settings = Settings.from_manifest(self.manifest, grpc_url, str(repository), model_name=args.model_name)
        if not self.settings.repository:
            raise SystemExit(
                "dynamo-worker: the TensorRT-LLM engine flavor's engine model does not stream in its default "
                "deployment: build it with --decoupled-mode (docs/dynamo.md)"
            )
        ensemble, engine_model, skip_special_tokens = streaming_parameters(repository)
        self.streams = EngineStreams(Parts.load(repository, ensemble, skip_special_tokens), engine_model)
        self.token_text = TokenTexts(self.streams.parts.preprocessor.tokenizer)
        self.vocab_size = len(self.streams.parts.preprocessor.tokenizer)
        self.relay = KvRelay(self.kv_events, KV_EVENT_BLOCK_TOKENS) if self.kv_events else None
        self.client: grpcaio.InferenceServerClient | None = None
        self._streaming: dict[str, StreamedRequest] = {}  # by Dynamo's request id, for abort

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[TritonWorkerEngine, WorkerConfig]:
        args = parser().parse_args(argv)
        engine = cls(args)
        config = WorkerConfig(
            namespace=args.namespace,
            component=args.component,
            endpoint=args.endpoint,
            model_name=engine.settings.tokenizer_dir,  # the folder Dynamo's frontend takes the tokenizer from
            served_model_name=engine.settings.model_name,
            discovery_backend=args.discovery_backend,
            request_plane=args.request_plane,
            event_plane=args.event_plane,
            enable_kv_routing=engine.relay is not None,
        )
        return engine, config

    async def start(self, worker_id: int) -> EngineConfig:
        if self.server is not None:
            if self.kv_events:
                os.environ[KV_EVENTS_ENV] = self.kv_events  # the server's engine publishes there
            print(f"dynamo-worker: starting tritonserver on {self.server.repository} ...", flush=True)
            await asyncio.to_thread(self.server.start, self.args.load_timeout)
        self.client = grpcaio.InferenceServerClient(self.settings.grpc_url)
        engine = self.manifest.get("engine_config", {})
        cache_tokens = engine.get("kv_cache_tokens")
        return EngineConfig(
            model=self.settings.tokenizer_dir,
            served_model_name=self.settings.model_name,
            llm=LlmRegistration(
                context_length=self.settings.max_seq_len,
                kv_cache_block_size=KV_EVENT_BLOCK_TOKENS,
                total_kv_blocks=cache_tokens // KV_EVENT_BLOCK_TOKENS if cache_tokens else None,
                max_num_seqs=self.manifest.get("max_batch_size"),
            ),
        )

    async def generate(self, request: dict[str, Any], context: Context) -> AsyncGenerator[dict[str, Any], None]:
        tokens = list(request.get("token_ids") or [])
        settings = self.settings
        try:
            if not tokens:
                raise APIError(ErrorKind.INVALID_INPUT, "'token_ids': the prompt has no tokens", param="token_ids")
            body = completion_request(
                request, max(settings.max_seq_len - len(tokens), 1), self.vocab_size, settings.engine_additions
            )
            arrays = engine_arrays(body, self.vocab_size, settings.engine_additions)
            pipeline = self.streams.request(arrays, prompt_ids=tokens, token_ids=True)
            self._streaming[context.id()] = pipeline
            try:
                async with contextlib.aclosing(self.streams.deltas(self.client, pipeline)) as deltas:
                    async for delta in deltas:
                        yield chunk(delta, self.token_text)
            except (APIError, asyncio.CancelledError):
                if not (context.is_stopped() or context.is_killed()):
                    raise
                return  # abort() cancelled the stream: Dynamo dropped the request, and nobody reads on
            yield final_chunk(pipeline.final(pipeline.perf_metrics), settings.kv_cache_block_tokens)
        except APIError as exc:
            raise dynamo_error(exc) from None
        finally:
            self._streaming.pop(context.id(), None)

    async def abort(self, context: Context) -> None:
        """Dynamo dropped the request (its client went away, a stop string, a hidden stop token): Dynamo stops reading
        this generator, so its stream to the engine model is cancelled here, which ends the request in the engine."""
        pipeline = self._streaming.pop(context.id(), None)
        if pipeline is not None and pipeline.abort is not None:
            pipeline.abort()

    async def kv_event_sources(self) -> list[KvEventSource]:
        return [PushSource(on_ready=self.relay.start)] if self.relay is not None else []

    async def cleanup(self) -> None:
        if self.relay is not None:
            self.relay.stop()
        if self.client is not None:
            await self.client.close()
            self.client = None
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
            self.server = None


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--build-dir", default="build", help="the build to serve (default: build)")
    add_address_options(parser)
    parser.add_argument(
        "--grpc-url", help="a running server of the build to use (HOST:PORT), instead of starting one on the ports"
    )
    parser.add_argument(
        "--kv-events",
        help="the ZeroMQ endpoint the running server's engine publishes its KV events on (its $"
        f"{KV_EVENTS_ENV}); default: the server this worker starts, when the build has --prefix-cache",
    )
    parser.add_argument("--load-timeout", type=float, default=600.0, help="seconds to wait for the models to load")
    parser.add_argument("--model-name", help="the model's name in Dynamo (default: the model folder's name)")
    # Dynamo's own flags, with its names, defaults and environment variables.
    env = os.environ.get
    parser.add_argument("--namespace", default=env("DYN_NAMESPACE", "dynamo"), help="Dynamo namespace")
    parser.add_argument("--component", default="tritonllm", help="Dynamo component (default: tritonllm)")
    parser.add_argument("--endpoint", default="generate", help="Dynamo endpoint (default: generate)")
    parser.add_argument(
        "--discovery-backend",
        default=env("DYN_DISCOVERY_BACKEND", "etcd"),
        choices=("kubernetes", "etcd", "file", "mem"),
        help="Dynamo's discovery backend (default: $DYN_DISCOVERY_BACKEND or etcd; file: $DYN_FILE_KV)",
    )
    parser.add_argument("--request-plane", default=env("DYN_REQUEST_PLANE", "tcp"), choices=("tcp", "nats"))
    parser.add_argument("--event-plane", default=env("DYN_EVENT_PLANE"), choices=("zmq", "nats", None))
    return parser


async def _serve(argv: list[str]) -> None:
    engine, config = await TritonWorkerEngine.from_args(argv)
    await Worker(engine, config).run()


def main(argv: list[str] | None = None) -> int:
    # asyncio's own loop, not uvloop (Dynamo's default): tritonclient's gRPC streams run on grpc.aio.
    try:
        asyncio.run(_serve(sys.argv[1:] if argv is None else argv))
    except ServerError as exc:
        print(f"dynamo-worker: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
