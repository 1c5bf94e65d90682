"""python -m client "What is the capital of France?"  -- print the model's answer (--stream: as it is generated)."""

from __future__ import annotations

import argparse
import sys
import time

from client import DEFAULT_GRPC_URL, DEFAULT_URL, GenerationError, generate, stream


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client", description="Ask the served model.")
    parser.add_argument("prompt")
    parser.add_argument("--url", default=DEFAULT_URL, help=f"server HTTP address (default {DEFAULT_URL})")
    parser.add_argument(
        "--grpc-url", default=DEFAULT_GRPC_URL, help=f"gRPC address, for --stream (default {DEFAULT_GRPC_URL})"
    )
    parser.add_argument("--model", help="default: ensemble; tensorrt_llm_bls with --stream")
    parser.add_argument("--stream", action="store_true", help="print the text as it is generated (gRPC streaming)")
    parser.add_argument("-v", "--verbose", action="store_true", help="with --stream: time to first token and tokens/s")
    parser.add_argument("-n", "--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, help="> 0 samples; default greedy")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int, help="makes sampling repeatable")
    parser.add_argument("--stop", action="append", default=[], help="stop text (repeatable)")
    parser.add_argument(
        "--no-chat", dest="chat", action="store_false", help="send the prompt as is, without the model's chat template"
    )
    args = parser.parse_args(argv)
    options = {
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop": args.stop,
        "chat": args.chat,
    }
    url = args.grpc_url if args.stream else args.url
    try:
        if args.stream:
            _print_stream(args, options)
        else:
            print(generate(args.prompt, args.max_tokens, url=url, model=args.model or "ensemble", **options))
    except GenerationError as exc:
        print(f"error from server: {exc}", file=sys.stderr)
        return 1
    except OSError:
        print(f"error: no server at {url}. Start one with `make serve` (or pass --url / --grpc-url).", file=sys.stderr)
        return 2
    return 0


def _print_stream(args: argparse.Namespace, options: dict) -> None:
    started = time.perf_counter()
    first = None
    final = None
    model = args.model or "tensorrt_llm_bls"
    for chunk in stream(args.prompt, args.max_tokens, url=args.grpc_url, model=model, **options):
        if chunk.text and first is None:
            first = time.perf_counter() - started
        print(chunk.text, end="", flush=True)
        final = chunk
    print()
    if args.verbose and final is not None and final.num_output_tokens:
        elapsed = time.perf_counter() - started
        first = first if first is not None else elapsed
        after_first = elapsed - first
        rate = (final.num_output_tokens - 1) / after_first if final.num_output_tokens > 1 and after_first > 0 else 0.0
        print(
            f"[{final.num_output_tokens} tokens, finish: {final.finish_reason}; time to first token "
            f"{first * 1000:.0f} ms, then {rate:.1f} tokens/s; total {elapsed:.2f} s]",
            file=sys.stderr,
        )


if __name__ == "__main__":
    sys.exit(main())
