"""Two versions of the code, or of the build, through `bench-pipeline`, in alternated rounds: which is ahead, and by
how much.

    git worktree add ../base HEAD~1        # the code to compare against
    python -m benchmarks.pipeline_ab --base ../base --rounds 3 --out /tmp/ab --levels 512 --targets bls_grpc
    GPU_SCRIPT=benchmarks/pipeline_ab.py bash benchmarks/gpu_bench.sh --base ../base ...   # on the GPU host
    python -m benchmarks.pipeline_ab --base-build-args="--engine-process" --levels 512 \\
        --build-args --engine-process --engine-instances 4   # this checkout, two builds

Without --base, both sides run this checkout; --base-build-args gives the base side its own build options in place
of those after --build-args (with `=`: its value starts with a dash).

Each round runs each checkout's own benchmarks/pipeline.py once (its own build and server), the order alternating
from round to round; options this script does not know go to pipeline.py as they are. A run's working directory is
its checkout: the Python backend's stubs and the OpenAI layer import the project from there first (the stubs'
embedded interpreter ignores PYTHONPATH), so putting the base's code on PYTHONPATH alone would measure this
checkout twice. Printed, and written to OUT/ab.md: per entry point and level, each side's median tokens/s with its
range, the median of the per-round ratios (this checkout / base) with its range, and a verdict (ahead or behind when
every round says so, else within noise).
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import subprocess
import sys
from pathlib import Path

from benchmarks.peers import compared, median, spread

HERE = Path(__file__).resolve().parents[1]


def run(checkout: Path, out: Path, options: list[str]) -> dict[tuple[str, int], float]:
    """One pipeline run of `checkout`'s code: tokens/s per (target, level). `options` last: pipeline.py's
    --build-args takes every option after it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, str(checkout / "benchmarks" / "pipeline.py"), "--out", str(out), *options]
    code = subprocess.run(command, cwd=checkout, env=env).returncode
    if code != 0:
        raise SystemExit(f"pipeline_ab: {' '.join(command)} exited with {code} (in {checkout})")
    with (out / "pipeline.csv").open() as rows:
        return {(r["target"], int(r["concurrency"])): float(r["output_tokens_per_s"]) for r in csv.DictReader(rows)}


def report(this: list[dict], base: list[dict]) -> str:
    lines = [
        "| target | streams | tokens/s, this: median (range) | base | this / base, each round: median | range "
        "| verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in sorted({key for run in this + base for key in run}, key=lambda k: (k[1], k[0])):
        sides = []
        for runs in (this, base):
            values = [r[key] for r in runs if key in r]
            sides.append(f"{median(values):,.0f} ({spread(values)})" if values else "—")
        ratios = [t[key] / b[key] for t, b in zip(this, base, strict=True) if key in t and b.get(key)]
        lines.append(f"| {key[0]} | {key[1]} | {sides[0]} | {sides[1]} | {compared(ratios, '.3f', 1.0)} |")
    return "\n".join(lines) + "\n"


def split_build_args(options: list[str]) -> tuple[list[str], list[str]]:
    """pipeline.py's options before --build-args, and the build options after it (none without it)."""
    if "--build-args" not in options:
        return options, []
    at = options.index("--build-args")
    return options[:at], options[at + 1 :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--base", type=Path, default=HERE, help="the checkout to compare this one against (default: this)"
    )
    parser.add_argument(
        "--base-build-args",
        metavar="ARGS",
        help="the base side's build options, in place of --build-args's (one string: --base-build-args=\"...\")",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running both checkouts once")
    parser.add_argument("--out", type=Path, default=Path("build/bench-ab"))
    parser.add_argument("--tokenizer-dir", type=Path, help="passed on to pipeline.py, made absolute")
    parser.add_argument("--build-dir", type=Path, default=HERE / "build", help="its tokenizer, for both")
    args, options = parser.parse_known_args(argv)
    base = args.base.resolve()
    if not (base / "benchmarks" / "pipeline.py").is_file():
        raise SystemExit(f"pipeline_ab: {base} is not a checkout of this project (git worktree add {base} REV)")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    options = ["--build-dir", str(args.build_dir.resolve()), *options]
    if args.tokenizer_dir is not None:
        options = ["--tokenizer-dir", str(args.tokenizer_dir.resolve()), *options]
    sides = {"this": (HERE, options), "base": (base, options)}
    if args.base_build_args is not None:
        common, _ = split_build_args(options)
        sides["base"] = (base, [*common, "--build-args", *shlex.split(args.base_build_args)])
    if split_build_args(sides["this"][1]) == split_build_args(sides["base"][1]) and base == HERE:
        parser.error("both sides are this checkout with the same build: give --base, or --base-build-args that differ")
    out = args.out.resolve()
    results: dict[str, list[dict]] = {"this": [], "base": []}
    for round_ in range(args.rounds):
        order = ["this", "base"] if round_ % 2 == 0 else ["base", "this"]
        for side in order:
            checkout, side_options = sides[side]
            results[side].append(run(checkout, out / f"{round_}-{side}", side_options))
    text = report(results["this"], results["base"])
    (out / "ab.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
