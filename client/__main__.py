"""python -m client "What is the capital of France?"  -- print the model's answer."""

from __future__ import annotations

import argparse
import sys

from client import DEFAULT_URL, GenerationError, generate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client", description="Ask the served model over HTTP.")
    parser.add_argument("prompt")
    parser.add_argument("--url", default=DEFAULT_URL, help=f"server HTTP address (default {DEFAULT_URL})")
    parser.add_argument("--model", default="ensemble")
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
    try:
        text = generate(
            args.prompt,
            args.max_tokens,
            url=args.url,
            model=args.model,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop=args.stop,
            chat=args.chat,
        )
    except GenerationError as exc:
        print(f"error from server: {exc}", file=sys.stderr)
        return 1
    except OSError:
        print(f"error: no server at {args.url}. Start one with `make serve` (or pass --url).", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
