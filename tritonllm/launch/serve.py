"""`make serve`: run tritonserver on the built repository until Ctrl-C."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tritonllm.launch.pytriton_wheel import ServerError
from tritonllm.launch.server_command import ADMIN_KEY_FILE, add_address_options, admin_key
from tritonllm.launch.tritonserver import OpenAIFrontend, TritonServer, probe_engine
from tritonllm.protocol import ADMIN_KEY_ENV
from tritonllm.repository.render import stale_build


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM (docker stop, systemd) stops the server as cleanly as Ctrl-C does."""
    raise KeyboardInterrupt


def supervise(server: TritonServer, interval: float, load_timeout: float) -> int:
    """Wait on tritonserver; restart it when its engine stops answering (waiting for the models as the first start
    did, `load_timeout` seconds).

    tritonserver 2.51 neither restarts a Python-backend stub that died nor stops reporting ready,
    and requests waiting on the dead engine would hang: so a probe asks the engine every
    `interval` seconds, and after two failures in a row the server is killed (its clients get an
    error at once, and /v2/health/ready stops answering) and started again.
    """
    failures = 0
    while True:
        try:
            code = server.process.wait(timeout=interval if interval > 0 else None)
        except subprocess.TimeoutExpired:
            problem = probe_engine(f"{server.host}:{server.grpc_port}")
            failures = failures + 1 if problem else 0
            if failures >= 2:
                print(
                    f"serve: the engine does not answer ({problem}); restarting tritonserver",
                    file=sys.stderr,
                    flush=True,
                )
                server.kill()
                server.start(timeout=load_timeout)
                print("serve: tritonserver is ready again", file=sys.stderr, flush=True)
                failures = 0
            continue
        print(f"tritonserver exited with code {code}", file=sys.stderr)
        return code or 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repository", type=Path, default=Path("build/model_repository"))
    add_address_options(parser)
    parser.add_argument("--load-timeout", type=float, default=600.0, help="seconds to wait for the models to load")
    parser.add_argument(
        "--admin-key",
        default=os.environ.get(ADMIN_KEY_ENV),
        help="restrict the model-repository, shared-memory, logging and trace APIs to requests with header "
        "tritonllm-admin-key: KEY (default: $TRITONLLM_ADMIN_KEY; when --host is not loopback, a random key, "
        f"written to {ADMIN_KEY_FILE} beside the repository, readable by this user only)",
    )
    parser.add_argument(
        "--watchdog-seconds",
        type=float,
        default=5.0,
        help="how often to check that the engine answers; 0: never (docs/deploy.md, 'Faults and the watchdog')",
    )
    parser.add_argument("--openai-port", type=int, default=9000, help="OpenAI-compatible API port (0: off)")
    parser.add_argument("--model-name", help="the model name of the OpenAI API (default: the model folder's name)")
    parser.add_argument(
        "--openai-workers",
        type=int,
        help="processes of the OpenAI layer (default: one per two cores, at most eight; tritonllm/openai/workers.py)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("TRITONLLM_API_KEY"),
        help="OpenAI API key clients must send (default: $TRITONLLM_API_KEY; none: open)",
    )
    args = parser.parse_args(argv)

    repository = args.repository.resolve()
    manifest_path = repository.parent / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else None  # none: a hand-made one
    if manifest is not None and (why := stale_build(manifest)):
        print(f"serve: {repository.parent}: {why}: run `make build` again", file=sys.stderr)
        return 2
    args.admin_key = admin_key(args.host, args.admin_key, "serve", repository.parent / ADMIN_KEY_FILE)
    server = TritonServer(
        repository,
        repository.parent / "tritonserver",
        args.http_port,
        args.grpc_port,
        args.metrics_port,
        args.host,
        admin_key=args.admin_key,
    )
    frontend = None
    if args.openai_port:
        if manifest is None:
            print(f"serve: {manifest_path} is missing: the OpenAI layer needs the build's (run `make build`)")
            return 2
        frontend = OpenAIFrontend.for_build(
            f"{args.host}:{args.grpc_port}",
            manifest,
            args.openai_port,
            host=args.host,
            api_key=args.api_key,
            model_name=args.model_name,
            workers=args.openai_workers,
            repository=str(repository),
            admin_key=args.admin_key,
        )
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        print(f"Starting tritonserver on {repository} ...", flush=True)
        server.start(timeout=args.load_timeout)
        if frontend:
            frontend.start()
        url = f"{args.host}:{args.http_port}"
        lines = [
            f"\nReady: HTTP {url}, gRPC {args.host}:{args.grpc_port}, metrics http://{args.host}:{args.metrics_port}/metrics",
            "Try, in another shell:",
            f'  .venv/bin/python -m client --url {url} "What is the capital of France?"',
            f'  .venv/bin/python -m client --grpc-url {args.host}:{args.grpc_port} --stream "Write a haiku"',
            f"  curl -s -X POST http://{url}/v2/models/ensemble/generate "
            '-d \'{"text_input": "What is the capital of France?", "max_tokens": 64, "apply_chat_template": true}\'',
        ]
        if frontend:
            lines.append(f"  OpenAI-compatible API: {frontend.url}/v1, model `{frontend.served_name}`")
        lines.append("Ctrl-C stops the server.\n")
        print("\n".join(lines), flush=True)
        return supervise(server, args.watchdog_seconds, args.load_timeout)
    except ServerError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nStopping tritonserver ...", flush=True)
        return 0
    finally:
        if frontend:
            frontend.stop()
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
