"""The GPU comparison (NVIDIA H200): the portable engine served by Triton against transformers in-process.

Runs on the lent GPU machine (no network, no real weights): builds a model of the Qwen2.5-7B shape
with random bf16 weights (SmolLM2's tokenizer, whose ids fit the vocabulary), measures transformers'
continuous batching in-process, then serves the same folder with `build_engines.py` +
tritonserver and measures output tokens/s through `tensorrt_llm_bls` (gRPC streaming), with the same
workload: N requests of PROMPT_TOKENS prompt + OUTPUT_TOKENS generated tokens. Prints JSON lines;
perf/gpu_bench.sh sets up the environment (docs/PERFORMANCE.md records the runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QWEN_7B = dict(  # Qwen2.5-7B's shape (config.json of the released model)
    architectures=["Qwen2ForCausalLM"],
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    model_type="qwen2",
)


def make_model(out: Path, tokenizer_dir: Path):
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in QWEN_7B.items() if k != "architectures"})
    config.architectures = QWEN_7B["architectures"]
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None
    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.glob("*"):
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    return model


def prompts(tokenizer, n: int, tokens: int) -> list[list[int]]:
    base = tokenizer("The quick brown fox jumps over the lazy dog and keeps running far away. ")["input_ids"]
    return [((base * (tokens // len(base) + 2))[i % 7 : i % 7 + tokens]) for i in range(n)]


def in_process(model, ids: list[list[int]], output_tokens: int, graphs: bool) -> float:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=output_tokens, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(use_cuda_graph=graphs, max_memory_percent=0.5)
    rate = 0.0
    for _ in range(2):  # the second run is warm: CUDA graphs captured, allocator settled
        torch.cuda.synchronize()
        started = time.perf_counter()
        outputs = model.generate_batch(ids, generation_config=config, continuous_batching_config=cb)
        elapsed = time.perf_counter() - started
        rate = sum(len(o.generated_tokens) for o in outputs.values()) / elapsed
    return rate


def generate_batch_1(model, ids: list[int], tokens: int) -> float:
    """Plain `generate`, batch 1: the single-stream baseline."""
    prompt = torch.tensor([ids], device="cuda")
    options = {"do_sample": False, "max_new_tokens": tokens, "min_new_tokens": tokens, "pad_token_id": 0}
    model.generate(prompt, **options)
    torch.cuda.synchronize()
    started = time.perf_counter()
    model.generate(prompt, **options)
    torch.cuda.synchronize()
    return tokens / (time.perf_counter() - started)


async def served(grpc_url: str, ids_text: list[str], output_tokens: int, concurrency: int) -> dict:
    import tritonclient.grpc as grpcclient
    import tritonclient.grpc.aio as grpcaio

    client = grpcaio.InferenceServerClient(grpc_url)
    jobs = iter(range(len(ids_text)))
    counts, firsts, ends = [], [], []

    async def one(i: int) -> None:
        tensors = [
            ("text_input", np.array([[ids_text[i].encode()]], dtype=object), "BYTES"),
            ("max_tokens", np.array([[output_tokens]], np.int32), "INT32"),
            ("end_id", np.array([[-1]], np.int32), "INT32"),
            ("stream", np.array([[True]]), "BOOL"),
        ]
        inputs = []
        for name, value, dt in tensors:
            t = grpcclient.InferInput(name, list(value.shape), dt)
            t.set_data_from_numpy(value)
            inputs.append(t)

        async def requests():
            yield {"model_name": "tensorrt_llm_bls", "inputs": inputs, "request_id": uuid.uuid4().hex}

        start, first = time.perf_counter(), None
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                raise RuntimeError(error.message())
            if first is None:
                first = time.perf_counter() - start
            n = result.as_numpy("num_output_tokens")
            if n is not None:
                counts.append(int(n.reshape(-1)[0]))
        firsts.append(first)
        ends.append(time.perf_counter())

    async def worker():
        for i in jobs:
            await one(i)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    await client.close()
    return {
        "output_tokens_per_s": round(sum(counts) / elapsed, 1),
        "requests": len(counts),
        "ttft_p50_ms": round(float(np.percentile(firsts, 50)) * 1000, 1),
        "seconds": round(elapsed, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpubench"))
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--skip-in-process", action="store_true")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    model_dir = args.work / "qwen7b-random"
    model = make_model(model_dir, args.tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    ids = prompts(tokenizer, args.requests, args.prompt_tokens)
    report = {
        "gpu": torch.cuda.get_device_name(),
        "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 2),
    }
    if not args.skip_in_process:
        report["generate_batch_1"] = round(generate_batch_1(model, ids[0], 64), 1)
        for graphs in (False, True):
            rate = in_process(model, ids, args.output_tokens, graphs)
            report[f"in_process_cuda_graphs_{graphs}"] = round(rate, 1)
            print(json.dumps(report), flush=True)
    started = time.perf_counter()
    model.save_pretrained(model_dir)
    report["save_s"] = round(time.perf_counter() - started, 1)
    del model
    torch.cuda.empty_cache()

    from tritonllm.build import main as build_main
    from tritonllm.server import TritonServer

    build = args.work / "build"
    code = build_main(
        [
            "--model",
            str(model_dir),
            "--build-dir",
            str(build),
            "--device",
            "cuda",
            "--dtype",
            "bfloat16",
            "--max-batch-size",
            str(args.requests),
            "--max-queue-size",
            str(args.requests),
            "--max-seq-len",
            str(args.prompt_tokens + args.output_tokens + 64),
            "--max-input-len",
            str(args.prompt_tokens + 32),
            "--kv-cache-gib",
            "40",
            "--max-batch-tokens",
            "4096",
        ]
    )
    assert code == 0
    server = TritonServer.on_free_ports(build, log_file=args.work / "server.log")
    started = time.perf_counter()
    server.start(timeout=540)
    report["server_ready_s"] = round(time.perf_counter() - started, 1)
    try:
        texts = [tokenizer.decode(i) for i in ids]
        grpc_url = f"{server.host}:{server.grpc_port}"
        asyncio.run(served(grpc_url, texts[:8], 8, 8))  # warm-up
        report["served_c1"] = asyncio.run(served(grpc_url, texts[:3], args.output_tokens, 1))
        print(json.dumps(report), flush=True)
        report[f"served_c{args.requests}"] = asyncio.run(served(grpc_url, texts, args.output_tokens, args.requests))
    finally:
        server.stop()
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
