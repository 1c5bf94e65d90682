"""`make serve`: run tritonserver on the built repository until Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from tritonllm.server import ServerError, TritonServer


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM (docker stop, systemd) stops the server as cleanly as Ctrl-C does."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repository", type=Path, default=Path("build/model_repository"))
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--load-timeout", type=float, default=600.0, help="seconds to wait for the models to load")
    args = parser.parse_args(argv)

    repository = args.repository.resolve()
    server = TritonServer(
        repository, repository.parent / "tritonserver", args.http_port, args.grpc_port, args.metrics_port, args.host
    )
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        print(f"Starting tritonserver on {repository} ...", flush=True)
        server.start(timeout=args.load_timeout)
        url = f"{args.host}:{args.http_port}"
        print(
            f"\nReady: HTTP {url}, gRPC {args.host}:{args.grpc_port}, metrics http://{args.host}:{args.metrics_port}/metrics\n"
            f"Try, in another shell:\n"
            f'  .venv/bin/python -m client --url {url} "What is the capital of France?"\n'
            f"  curl -s -X POST http://{url}/v2/models/ensemble/generate "
            '-d \'{"text_input": "What is the capital of France?", "max_tokens": 64, "apply_chat_template": true}\'\n'
            "Ctrl-C stops the server.\n",
            flush=True,
        )
        code = server.process.wait()
        print(f"tritonserver exited with code {code}", file=sys.stderr)
        return code or 1
    except ServerError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        server.stop()
        return 1
    except KeyboardInterrupt:
        print("\nStopping tritonserver ...", flush=True)
        server.stop()
        return 0


if __name__ == "__main__":
    sys.exit(main())
