"""`tritonllm COMMAND ...`: one entry point for every command; the Makefile's targets call it.

The package's own commands are imported here, when run; the benchmarks, which live in the source checkout's
benchmarks/ and not in the package, declare themselves as entry points of the `tritonllm.commands` group
(pyproject.toml), so the runtime package never names them. Each command's own options: `tritonllm COMMAND --help`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

PLUGIN_GROUP = "tritonllm.commands"


def _build(argv: list[str]) -> int:
    from tritonllm.repository import builder

    return builder.main(argv)


def _serve(argv: list[str]) -> int:
    from tritonllm.launch import serve

    return serve.main(argv)


def _serve_trtllm(argv: list[str]) -> int:
    from tritonllm.launch import serve_trtllm

    return serve_trtllm.main(argv)


def _openai(argv: list[str]) -> int:
    from tritonllm.openai import app

    return app.main(argv)


def _dynamo(command: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        if importlib.util.find_spec("dynamo") is None:
            print(f"tritonllm {command}: NVIDIA Dynamo is not installed: run `make dynamo`", file=sys.stderr)
            return 2
        module = importlib.import_module(f"tritonllm.dynamo.{command.removeprefix('dynamo-')}")
        return module.main(argv)

    return run


def _container(argv: list[str]) -> int:
    from tritonllm.launch import container

    return container.main(argv)


def _probe(argv: list[str]) -> int:
    from tritonllm.launch import container

    return container.main(["probe", *argv])


def _preflight(argv: list[str]) -> int:
    from tritonllm.launch import preflight

    return preflight.main()


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "build": (_build, "render the model repository (and build a TensorRT-LLM engine)"),
    "serve": (_serve, "serve the portable flavor: tritonserver and the OpenAI layer"),
    "serve-trtllm": (_serve_trtllm, "serve the TensorRT-LLM flavor in NVIDIA's image"),
    "openai": (_openai, "the OpenAI-compatible layer alone, in front of a running server"),
    "dynamo-worker": (_dynamo("dynamo-worker"), "this server as a worker of NVIDIA Dynamo (its frontend, KV router)"),
    "dynamo-fleet": (_dynamo("dynamo-fleet"), "Dynamo's frontend and several workers on this machine"),
    "container": (_container, "the image's entrypoint: build-once, launch, probe"),
    "probe": (_probe, "exit 0 when the engine answers (a liveness probe)"),
    "preflight": (_preflight, "check this host before installing"),
}


def plugins() -> dict[str, EntryPoint]:
    """The commands declared by the source checkout (the benchmarks), by name."""
    return {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name not in COMMANDS}


def usage() -> str:
    listed = {name: what for name, (_, what) in COMMANDS.items()}
    listed.update({name: f"{ep.value.partition(':')[0]} (source checkout)" for name, ep in plugins().items()})
    width = max(map(len, listed))
    lines = [f"  {name:<{width}}  {what}" for name, what in listed.items()]
    return "usage: tritonllm COMMAND [OPTIONS]\n\ncommands:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command in COMMANDS:
        run = COMMANDS[command][0]
    elif (plugin := plugins().get(command)) is not None:
        try:
            run = plugin.load()
        except ModuleNotFoundError as exc:
            print(f"tritonllm {command}: needs the source checkout ({exc.name} is not importable)", file=sys.stderr)
            return 2
    else:
        print(f"tritonllm: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    sys.argv[0] = f"tritonllm {command}"  # argparse's usage line names the command
    return run(rest)


if __name__ == "__main__":
    raise SystemExit(main())
