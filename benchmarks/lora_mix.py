"""The llama.cpp engine's throughput with LoRA adapters: one batch of requests, all for the base model, all for one
adapter, or split between the base and adapters, run in the engine's process (no server in front).

llama.cpp applies adapters to a context, so each engine step decodes once per adapter in use (tritonllm/engine/
llamacpp.py): a mixed batch costs more decodes of fewer tokens each. The adapters are random (PEFT, rank --rank on
every linear layer), converted as `--lora` converts them; their weights do not change the cost. Every request
generates --max-tokens tokens (no end id) from the same prompts; each mix runs once per round, rounds alternate.

    .venv/bin/python -m benchmarks.lora_mix --build-dir build   # the build's GGUF (make build)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

MIXES = {  # name -> the adapter of each request, in turn ("" = the base model)
    "base only": [""],
    "one adapter": ["a0"],
    "base + 1 adapter": ["", "a0"],
    "base + 3 adapters": ["", "a0", "a1", "a2"],
}
PROMPTS = ["What is the capital of France?", "Write a haiku about autumn.", "Explain what a compiler does."]


def make_adapters(model_dir: str, gguf: Path, count: int, rank: int, folder: Path) -> list[dict]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tritonllm.engine.lora_gguf import convert_peft

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = []
    for index in range(count):
        torch.manual_seed(index)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=rank, target_modules=targets, init_lora_weights=False))
        model.save_pretrained(folder / f"a{index}")
        adapter = convert_peft(f"a{index}", folder / f"a{index}", gguf, folder)
        adapters.append(dataclasses.replace(adapter, task_id=index + 1).as_json())
    return adapters


class DecodeTimes:
    """llama_decode's wall time, split by whether an adapter was set on the context just before (llama.cpp then
    reserves its compute graph again): wraps the two llama.cpp calls the engine makes."""

    def __init__(self, llama) -> None:
        self.after_set: list[float] = []
        self.plain: list[float] = []
        self._set = False
        decode, set_adapters = llama.llama_decode, llama.llama_set_adapters_lora

        def timed_decode(ctx, batch):
            started = time.perf_counter()
            code = decode(ctx, batch)
            (self.after_set if self._set else self.plain).append(time.perf_counter() - started)
            self._set = False
            return code

        def noted_set(*args):
            self._set = True
            return set_adapters(*args)

        llama.llama_decode, llama.llama_set_adapters_lora = timed_decode, noted_set

    def report(self) -> str:
        def ms(values: list[float]) -> str:
            return f"{1000 * statistics.median(values):.1f} ms (n={len(values)})" if values else "none"

        return f"llama_decode median: {ms(self.plain)}; right after an adapter was set: {ms(self.after_set)}"


def run_mix(engine, prompts: list[list[int]], adapters: list[str], batch: int, max_tokens: int) -> float:
    """Generated tokens per second of `batch` requests at once, request i for adapters[i % len(adapters)]."""
    from tritonllm.engine.api import GenerationRequest

    done = threading.Semaphore(0)
    counts = [0] * batch

    def emit_for(i: int):
        def emit(emission) -> None:
            counts[i] += len(emission.token_ids)
            if emission.final:
                done.release()

        return emit

    started = time.perf_counter()
    for i in range(batch):
        request = GenerationRequest(prompts[i % len(prompts)], max_tokens, adapter=adapters[i % len(adapters)])
        engine.submit(request, emit_for(i))
    for _ in range(batch):
        done.acquire()
    return sum(counts) / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build-dir", type=Path, default=Path("build"))
    parser.add_argument("--batch", type=int, default=8, help="requests at once")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from tritonllm.engine.api import EngineConfig
    from tritonllm.engine.llamacpp import LlamaCppEngine

    config = EngineConfig(**json.loads((args.build_dir / "manifest.json").read_text())["engine_config"])
    tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for p in PROMPTS
    ]
    with tempfile.TemporaryDirectory() as folder:
        adapters = make_adapters(config.model_dir, Path(config.gguf_file), 3, args.rank, Path(folder))
        import llama_cpp

        times = DecodeTimes(llama_cpp)
        engine = LlamaCppEngine(dataclasses.replace(config, lora_adapters=adapters, prefix_cache=False, cpu_niceness=0))
        try:
            run_mix(engine, prompts, [""], args.batch, 8)  # warm-up
            rates: dict[str, list[float]] = {mix: [] for mix in MIXES}
            for _ in range(args.rounds):
                for mix, chosen in MIXES.items():
                    rates[mix].append(run_mix(engine, prompts, chosen, args.batch, args.max_tokens))
        finally:
            engine.shutdown()
    base = statistics.median(rates["base only"])
    print(f"{args.batch} requests at once, {args.max_tokens} tokens each, rank {args.rank}, {args.rounds} rounds")
    print("| mix | output tokens/s (median) | range | vs base only |\n|---|---|---|---|")
    for mix, values in rates.items():
        median = statistics.median(values)
        print(f"| {mix} | {median:.0f} | {min(values):.0f} to {max(values):.0f} | {median / base:.2f} |")
    print(times.report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
