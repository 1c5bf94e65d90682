"""An OpenAI-compatible API in front of the running Triton server.

    python -m tritonllm.openai.app --manifest build/manifest.json [--port 9000] [--workers N]

`GET /v1/models`, `POST /v1/completions` and `POST /v1/chat/completions` (with `stream: true` as
server-sent events ending in `data: [DONE]`), so the `openai` client, LangChain, LiteLLM and chat
UIs work unchanged. It is a thin FastAPI layer: chat messages go through the tokenizer's chat
template, and every generation is one gRPC stream: to the engine model with the per-request pipeline run here
(--repository, the portable flavor), else to `tensorrt_llm_bls` (a client that disconnects cancels its stream,
which frees its place in the engine). No model is loaded here.

It runs as --workers processes on one port (uvicorn's workers, each listening on a socket of its own, among which
the kernel spreads connections by address: workers.py), since one Python process tops out at about a core's worth of
streamed tokens (docs/performance.md). A worker holds no state
another needs: every request's state lives in Triton, and a busy server answers 429 from its own queue.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import secrets
import sys
import traceback
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from uvicorn.config import STARTUP_FAILURE

from tritonllm.errors import ErrorKind
from tritonllm.openai import routes
from tritonllm.openai.chat_models import ChatRequest
from tritonllm.openai.generation import Generator
from tritonllm.openai.models import APIError, CompletionRequest, LoadLoraAdapter, UnloadLoraAdapter
from tritonllm.openai.settings import Settings
from tritonllm.openai.workers import port_free, supervise_workers
from tritonllm.options import carrier_count
from tritonllm.protocol import ADMIN_HEADER, ADMIN_KEY_ENV, OPENAI_PORT, PORTS, is_loopback


def bearer_credentials(authorization: bytes) -> bytes | None:
    """The credentials of an `Authorization: Bearer KEY` header, None under another scheme or none. The scheme is
    case-insensitive (RFC 7235 section 2.1, RFC 6750 section 2.1: "bearer KEY" is a Bearer credential too)."""
    parts = authorization.split(None, 1)
    if len(parts) != 2 or parts[0].lower() != b"bearer":
        return None
    return parts[1].strip()


class ApiKey:
    """`Authorization: Bearer KEY` on /v1/ paths, the key compared in constant time. A plain ASGI middleware:
    Starlette's `@app.middleware("http")` relays every chunk of a streamed answer through its own tasks and queues,
    a fifth of the layer's CPU under load (docs/performance.md, "The pipeline's ceiling")."""

    def __init__(self, app, key: str) -> None:
        # Bytes, not text: compare_digest refuses a str that is not ASCII (a TypeError, a 500), and an HTTP header may
        # carry any byte (obs-text); the key is compared as UTF-8, whatever it holds.
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = bearer_credentials(dict(scope["headers"]).get(b"authorization", b""))
            if given is None or not secrets.compare_digest(given, self.key):
                error = APIError(ErrorKind.UNAUTHORIZED, "Incorrect or missing API key", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


MAX_BODY_BYTES = 8 * 2**20  # a request body: far above any prompt the model takes (routes.py refuses those by size)


class BodyLimit:
    """Refuses a body over MAX_BODY_BYTES with a 413 before anything parses it: by its Content-Length, or, for a
    chunked body, once its chunks pass the limit (they are held, then handed on)."""

    def __init__(self, app, limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.limit:
                await self.refuse(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.limit:
                await self.refuse(scope, receive, send)
                return
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def refuse(self, scope, receive, send) -> None:
        error = APIError(ErrorKind.TOO_LARGE, f"the request body is over the limit of {self.limit} bytes")
        await error.response()(scope, receive, send)


def create_app(settings: Settings, generator: Generator | None = None) -> FastAPI:
    """The app; `generator` replaces the one made from `settings` (tests give one with a stand-in Triton)."""
    generator = generator or Generator(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await generator.close()

    app = FastAPI(title="tritonllm OpenAI-compatible API", lifespan=lifespan)

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
        message = f"{'.'.join(where) or 'body'}: {first.get('msg')}"
        if first.get("type") == "extra_forbidden":  # OpenAI's wording for a parameter it does not know
            message = f"Unrecognized request argument supplied: {'.'.join(where)}"
        return APIError(ErrorKind.INVALID_INPUT, message, param=param).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """Starlette's own refusals (an unknown path, a wrong method, a body it cannot read) in OpenAI's format."""
        kind = ErrorKind.NOT_FOUND if exc.status_code == 404 else ErrorKind.INVALID_INPUT
        error = APIError(kind, str(exc.detail))
        error.status = exc.status_code
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        """A bug: still an answer in OpenAI's format (not Starlette's plain text), the traceback in the log."""
        traceback.print_exception(exc)
        return APIError(ErrorKind.INTERNAL, f"internal error: {type(exc).__name__}").response()

    if settings.api_key:
        app.add_middleware(ApiKey, key=settings.api_key)
    app.add_middleware(BodyLimit)  # added last, so it runs first: before the key is even read

    @app.get("/v1/models")
    async def list_models() -> dict:
        await generator.adapters.refresh(generator.client)
        return {"object": "list", "data": routes.model_cards(generator)}

    @app.get("/v1/models/{name}")
    async def get_model(name: str) -> dict:
        await routes.check_model(generator, name)
        return next(card for card in routes.model_cards(generator) if card["id"] == name)

    # vLLM's routes and bodies for adapters while serving (tritonllm/openai/lora_admin.py); they answer with the
    # models served once the change is made: after an unload, once the requests using the adapter have finished.
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapter, request: Request) -> dict:
        admin_key = request.headers.get(ADMIN_HEADER)
        await generator.adapters.change(generator.client, "load", body.lora_name, body.lora_path, admin_key)
        return {"object": "list", "data": routes.model_cards(generator)}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapter, request: Request) -> dict:
        admin_key = request.headers.get(ADMIN_HEADER)
        await generator.adapters.change(generator.client, "unload", body.lora_name, "", admin_key)
        return {"object": "list", "data": routes.model_cards(generator)}

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 when Triton is ready, else 503: probes and launchers read the status."""
        ready = await generator.ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else ErrorKind.UNAVAILABLE.http_status)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await routes.completions(generator, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        return await routes.chat_completions(generator, body)

    return app


def open_layer_warning(host: str, port: int) -> str:
    return (
        f"openai: warning: listening on {host}:{port} without an API key: anyone who can reach this port can use "
        "the model; set TRITONLLM_API_KEY or --api-key (make serve API_KEY=...) to require `Authorization: Bearer KEY`"
    )


SETTINGS_VARIABLE = "TRITONLLM_OPENAI_SETTINGS"  # the settings, as JSON, for the worker processes uvicorn starts


def app_or_exit(settings: Settings) -> FastAPI:
    """`create_app`, or an exit with uvicorn's startup-failure code when it cannot be made (a tokenizer that does
    not load): in a worker that code stops the others (any other exit and uvicorn starts it again, and again), and
    the layer exits with it whether it runs one worker or several."""
    try:
        return create_app(settings)
    except Exception:
        traceback.print_exc()
        sys.exit(STARTUP_FAILURE)


def app_from_environment() -> FastAPI:
    """The app of one worker process, from the settings `main` left in the environment (uvicorn's factory)."""
    return app_or_exit(Settings(**json.loads(os.environ[SETTINGS_VARIABLE])))


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", type=Path, help="build/manifest.json: the tokenizer and the model's limits")
    parser.add_argument("--tokenizer-dir", help="without --manifest: the tokenizer folder")
    parser.add_argument("--max-seq-len", type=int, help="without --manifest: prompt + generated tokens")
    parser.add_argument("--max-input-len", type=int, help="without --manifest: prompt tokens the model takes")
    parser.add_argument(
        "--kv-cache-block-tokens",
        type=int,
        default=1,
        help="without --manifest: tokens per KV cache block, to count cached prompt tokens (1: the portable engine)",
    )
    parser.add_argument(
        "--tokenizer-class",
        default="",
        help="without --manifest: the tokenizer class the build recorded (its manifest's tokenizer_class); "
        "default: AutoTokenizer picks it",
    )
    parser.add_argument(
        "--trtllm",
        action="store_true",
        help="without --manifest: the server runs a TensorRT-LLM engine (none of the portable engine's additions)",
    )
    parser.add_argument(
        "--adapter",
        action="append",
        default=[],
        help="without --manifest: a LoRA adapter of the build (its manifest's engine_config.lora_adapters), served "
        "as a model of that name; repeat for more",
    )
    parser.add_argument(
        "--lora-admin",
        action="store_true",
        help="without --manifest: the build loads and unloads adapters while serving (--lora-dir): the engine model "
        "lists them, and /v1/load_lora_adapter and /v1/unload_lora_adapter change them (key: $TRITONLLM_ADMIN_KEY)",
    )
    parser.add_argument(
        "--repository",
        default="",
        help="the built model repository: each choice streams from the engine model, its text made here (with "
        "--manifest, the manifest's own, for the portable flavor); none: through tensorrt_llm_bls",
    )
    parser.add_argument("--grpc-url", default=f"127.0.0.1:{PORTS['grpc']}", help="the Triton server's gRPC address")
    parser.add_argument("--model-name", help="the name clients use (default: the tokenizer folder's name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=OPENAI_PORT)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("TRITONLLM_API_KEY"),
        help="require `Authorization: Bearer KEY` (default: $TRITONLLM_API_KEY; none: open)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=carrier_count(len(os.sched_getaffinity(0))),
        help="processes serving the port (default: one per two cores, at most eight)",
    )
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    if args.manifest:  # the build's own limits: never a second default that could disagree with them
        settings = Settings.from_manifest(
            json.loads(args.manifest.read_text()),
            args.grpc_url,
            args.repository or str(args.manifest.parent / "model_repository"),
            model_name=args.model_name,
            api_key=args.api_key or None,
            admin_key=os.environ.get(ADMIN_KEY_ENV) or None,
        )
    elif not (args.tokenizer_dir and args.max_input_len and args.max_seq_len):
        parser.error("give --manifest, or --tokenizer-dir with --max-input-len and --max-seq-len")
    else:
        settings = Settings(
            args.grpc_url,
            args.tokenizer_dir,
            args.model_name or Path(args.tokenizer_dir).name,
            args.max_input_len,
            args.max_seq_len,
            args.api_key or None,
            kv_cache_block_tokens=args.kv_cache_block_tokens,
            engine_additions=not args.trtllm,
            tokenizer_class=args.tokenizer_class,
            repository=args.repository,
            adapters=tuple(args.adapter),
            lora_admin=args.lora_admin,
            admin_key=os.environ.get(ADMIN_KEY_ENV) or None,
        )
    if not settings.api_key and not is_loopback(args.host):
        print(open_layer_warning(args.host, args.port), file=sys.stderr, flush=True)
    if args.workers == 1:
        if not port_free(args.host, args.port):  # the exit code of several workers', not uvicorn's 1
            return STARTUP_FAILURE
        uvicorn.run(app_or_exit(settings), host=args.host, port=args.port, log_level="warning")
        return 0
    # uvicorn starts each worker from an import string; this process only supervises them
    os.environ[SETTINGS_VARIABLE] = json.dumps(dataclasses.asdict(settings))
    return supervise_workers(args.workers, args.host, args.port)


if __name__ == "__main__":
    raise SystemExit(main())
