"""`tritonllm COMMAND ...`: one entry point for every command; the Makefile's targets call it.

Each command's own options: `tritonllm COMMAND --help`.
"""

from __future__ import annotations

import importlib
import sys

# command -> (module, what it does). perf and bench live in the source checkout's benchmarks/, not the package.
COMMANDS = {
    "build": ("tritonllm.repository.builder", "render the model repository (and build a TensorRT-LLM engine)"),
    "serve": ("tritonllm.launch.serve", "serve the portable flavor: tritonserver and the OpenAI layer"),
    "serve-trtllm": ("tritonllm.launch.serve_trtllm", "serve the TensorRT-LLM flavor in NVIDIA's image"),
    "openai": ("tritonllm.openai.app", "the OpenAI-compatible layer alone, in front of a running server"),
    "container": ("tritonllm.launch.container", "the image's entrypoint: build-once, launch, probe"),
    "probe": ("tritonllm.launch.container", "exit 0 when the engine answers (a liveness probe)"),
    "preflight": ("tritonllm.launch.preflight", "check this host before installing"),
    "perf": ("benchmarks.perf", "perf_analyzer and genai-perf sweeps (source checkout)"),
    "bench": ("benchmarks.bench", "the CPU ratios benchmark (source checkout)"),
    "bench-pipeline": ("benchmarks.pipeline", "the pipeline's ceiling over the synthetic engine (source checkout)"),
    "bench-peers": ("benchmarks.peers", "this server beside llama.cpp's and vLLM's on the CPU (source checkout)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "usage: tritonllm COMMAND [OPTIONS]\n\ncommands:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"tritonllm: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name = COMMANDS[command][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(f"tritonllm {command}: needs the source checkout ({module_name} is not installed)", file=sys.stderr)
            return 2
        raise
    sys.argv[0] = f"tritonllm {command}"  # argparse's usage line names the command
    if command == "probe":
        rest = ["probe", *rest]
    if command == "preflight":
        return module.main()
    return module.main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
