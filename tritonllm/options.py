"""Options defined once: a dataclass field made with `option` is also a command-line flag.

The field holds the default, the help (which docs/options.md is generated from), the choices or limits the
flag's parser checks, and whether it runs on CUDA only. `add_options` turns a dataclass's option fields
into argparse flags whose destinations are the field names, so `Class(**{name: args.name})` needs no
mapping of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing


def carrier_count(cores: int) -> int:
    """Processes of a step that carries every streamed token in its one interpreter (tensorrt_llm_bls's instances,
    the OpenAI layer's workers): one per two cores, 1 to 8. On a 16-core host four of either were each a full core at
    512 streams and eight were ahead (docs/performance.md, "Eight OpenAI workers and eight tensorrt_llm_bls
    instances"); a host of two or three cores gets one, its other core for the engine and Triton."""
    return max(1, min(8, cores // 2))


def option(
    default,
    help: str,
    *,
    cuda_only: bool = False,
    engine_only: str = "",
    choices: tuple = (),
    limits: tuple[float | None, float | None] | None = None,
    flag: str | None = None,
):
    """A dataclass field that is also a flag (`--name-with-dashes` unless `flag` names it); `limits` are
    inclusive (None: open); a None default is decided later (the help says how). `engine_only`: the one
    `--engine-impl` the option is for; the build refuses it, given, with another."""
    metadata = {
        "help": help,
        "cuda_only": cuda_only,
        "engine_only": engine_only,
        "choices": choices,
        "limits": limits,
        "flag": flag,
    }
    return dataclasses.field(default=default, metadata=metadata)


def option_fields(cls) -> list[dataclasses.Field]:
    """The fields of `cls` made with `option`."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata["flag"] or "--" + field.name.replace("_", "-")


def add_options(group, cls) -> None:
    """One flag per option field of `cls`, from its definition: type, default, choices, limits and help."""
    hints = typing.get_type_hints(cls)
    for field in option_fields(cls):
        _add(group, field, hints[field.name])


def _add(group, field: dataclasses.Field, kind) -> None:
    meta = field.metadata
    help_text = meta["help"] + (" (CUDA only)" if meta["cuda_only"] else "")
    help_text += f" (--engine-impl {meta['engine_only']} only)" if meta["engine_only"] else ""
    if kind in (bool, bool | None):
        if field.default is not None:
            help_text += f" (default: {'on' if field.default else 'off'})"
        action = argparse.BooleanOptionalAction
        group.add_argument(flag_of(field), dest=field.name, action=action, default=field.default, help=help_text)
        return
    scalar = int if kind is int else float if kind is float else str
    low, high = meta["limits"] or (None, None)

    def parse(text: str):
        value = scalar(text)
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"from {low} to {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    group.add_argument(
        flag_of(field),
        dest=field.name,
        type=parse,
        default=field.default,
        choices=meta["choices"] or None,
        help=help_text + " (default: %(default)s)",
    )
