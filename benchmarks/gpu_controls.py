"""The generation controls of the portable engine on a CUDA GPU: checks and their cost, in-process.

What the CPU tests cannot reach: CUDA graphs (each argument group a step uses keys its own graph) and
asynchronous batching (the host prepares a step before the previous token exists). A model of SmolLM2-135M's
shape with random weights (SmolLM2's tokenizer; the weights are scaled up so that greedy choices are not
near-ties) runs the same requests on three engines: eager, CUDA graphs with synchronous batching, and the
CUDA default (graphs and asynchronous batching). It prints JSON lines:

- `agree`: each control's tokens, per engine, equal the eager engine's (greedy and seeded requests together
  in one batch); each control changes the plain answer, a banned token stays out, min_tokens holds;
- `refused`: under asynchronous batching, log probabilities and guides are refused naming the input;
- `log_probs`: float32 engine against a float32 forward pass of the same model (max absolute difference);
- `guided`: JSON-schema and regex outputs validate;
- `cost`: output tokens/s at batch 1 and 32 with each control against plain decoding, per engine.

Run from the repository root on the GPU host, with transformers, xgrammar and jsonschema importable:
    python benchmarks/gpu_controls.py --tokenizer-dir DIR
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_bench import complete, cuda_engine, generated  # noqa: E402
from tritonllm.engine.api import GenerationRequest, Guide, Penalties, SamplingParams  # noqa: E402
from tritonllm.errors import InputError  # noqa: E402

SMOLLM2_135M = dict(  # SmolLM2-135M's shape (config.json of the released model)
    architectures=["LlamaForCausalLM"],
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    model_type="llama",
    bos_token_id=1,
    eos_token_id=2,
)
ENGINES = {
    "eager": {"cuda_graphs": False, "async_batching": False},
    "graphs": {"cuda_graphs": True, "async_batching": False},
    "graphs+async": {},  # the CUDA default
}
TOKENS = 24
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3},
]


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def make_model(out: Path, tokenizer_dir: Path, dtype: str) -> Path:
    import shutil

    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**SMOLLM2_135M)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # tied to the embeddings: peaky logits, so greedy picks are not near-ties
    model.to(getattr(torch, dtype)).save_pretrained(out)
    for path in tokenizer_dir.iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(path, out / path.name)
    return out


def control_requests(prompt: list[int], plain: list[int], end_id: int) -> dict[str, GenerationRequest]:
    base = dict(input_ids=prompt, max_new_tokens=TOKENS)
    return {
        "plain": GenerationRequest(**base),
        "repetition": GenerationRequest(**base, penalties=Penalties(repetition=3.0)),
        "presence_frequency": GenerationRequest(**base, penalties=Penalties(presence=0.8, frequency=0.6)),
        # The plain answer's third token as the end id: without min_tokens the request would end there.
        "min_tokens": GenerationRequest(**base, end_id=end_id, penalties=Penalties(min_tokens=TOKENS - 4)),
        "bias": GenerationRequest(**base, embedding_bias=((plain[0], float("-inf")), (plain[1], -5.0))),
        "top_k_1": GenerationRequest(**base, sampling=SamplingParams(sample=True, top_k=1, seed=3)),
        "bad_words": GenerationRequest(**base, bad_words=((plain[2],),)),
    }


def agreement(model_dir: Path, prompts: list[list[int]]) -> None:
    """Every control on every engine, all requests of a prompt in one batch, against the eager engine."""
    answers: dict[str, dict] = {}
    for name, options in ENGINES.items():
        with cuda_engine(model_dir, 64, 256, options) as engine:
            plain = generated(engine, [GenerationRequest(input_ids=p, max_new_tokens=TOKENS) for p in prompts], True)
            cases = {}
            for prompt, answer in zip(prompts, plain, strict=True):
                for case, request in control_requests(prompt, answer, answer[2]).items():
                    cases[(case, len(cases))] = request
            outputs = generated(engine, list(cases.values()), at_once=True)
            answers[name] = {key: out for key, out in zip(cases, outputs, strict=True)}
            answers[name]["_requests"] = cases
    eager = answers["eager"]
    requests = eager.pop("_requests")
    for name in ENGINES:
        answers[name].pop("_requests", None)
        per_case: dict[str, list[bool]] = {}
        for key, out in answers[name].items():
            per_case.setdefault(key[0], []).append(out == eager[key])
        emit({"agree": name, "with": "eager", **{case: all(v) for case, v in per_case.items()}})
    effects: dict[str, list[bool]] = {}
    plain_by_prompt = {tuple(r.input_ids): eager[k] for k, r in requests.items() if k[0] == "plain"}
    for key, request in requests.items():
        out, plain = eager[key], plain_by_prompt[tuple(request.input_ids)]
        if key[0] == "bias":
            effects.setdefault("bias_bans", []).append(plain[0] not in out)
        if key[0] == "bad_words":
            effects.setdefault("bad_word_absent", []).append(plain[2] not in out)
        if key[0] == "min_tokens":
            effects.setdefault("min_tokens_holds", []).append(len(out) >= TOKENS - 4)
        if key[0] in ("repetition", "presence_frequency", "bias"):
            effects.setdefault(f"{key[0]}_changes", []).append(out != plain)
        if key[0] == "top_k_1":
            effects.setdefault("top_k_1_is_greedy", []).append(out == plain)
    emit({"effects": {k: f"{sum(v)}/{len(v)}" for k, v in effects.items()}})


def refusals(model_dir: Path, prompt: list[int]) -> None:
    with cuda_engine(model_dir, 8, 256, ENGINES["graphs+async"]) as engine:
        for field, request in (
            ("return_log_probs", GenerationRequest(input_ids=prompt, max_new_tokens=4, log_probs=2)),
            ("guided_decoding_guide", GenerationRequest(input_ids=prompt, max_new_tokens=4, guide=Guide("json"))),
        ):
            try:
                engine.submit(request, lambda e: None)
                emit({"refused": field, "ok": False, "why": "accepted"})
            except InputError as exc:
                emit({"refused": field, "ok": exc.field == field, "message": str(exc)})


def log_probs(model_dir: Path, prompts: list[list[int]]) -> None:
    """A float32 engine (graphs, synchronous) against a float32 forward pass of the same weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda").eval()
    with cuda_engine(model_dir, 16, 256, {**ENGINES["graphs"], "dtype": "float32"}) as engine:
        requests = [GenerationRequest(input_ids=p, max_new_tokens=12, log_probs=5) for p in prompts]
        records: list[list] = [[] for _ in requests]
        complete(engine, requests, lambda i, e: records[i].append(e))
    worst_chosen = worst_top = 0.0
    for prompt, emissions in zip(prompts, records, strict=True):
        tokens = [t for e in emissions for t in e.token_ids]
        entries = [lp for e in emissions for lp in (e.log_probs or [])]
        assert len(entries) == len(tokens), (len(entries), len(tokens))
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens], device="cuda")).logits[0, len(prompt) - 1 : -1].float()
        reference = torch.log_softmax(logits, dim=-1).cpu()
        for position, (token, entry) in enumerate(zip(tokens, entries, strict=True)):
            worst_chosen = max(worst_chosen, abs(entry.log_prob - float(reference[position, token])))
            best = reference[position].topk(5)
            worst_top = max(worst_top, max(abs(v - float(best.values[i])) for i, (_, v) in enumerate(entry.top)))
    emit({"log_probs": "float32, graphs", "max_abs_diff_chosen": worst_chosen, "max_abs_diff_top5": worst_top})


def guided(model_dir: Path, prompt: list[int]) -> None:
    import jsonschema
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with cuda_engine(model_dir, 16, 256, ENGINES["graphs"]) as engine:
        requests = [
            GenerationRequest(
                input_ids=prompt,
                max_new_tokens=48,
                end_id=tokenizer.eos_token_id,
                guide=Guide("json_schema", json.dumps(s)),
            )
            for s in SCHEMAS
        ]
        requests.append(
            GenerationRequest(
                input_ids=prompt,
                max_new_tokens=16,
                end_id=tokenizer.eos_token_id,
                guide=Guide("regex", r"[0-9]{3}-[a-z]{2}"),
            )
        )
        outputs = generated(engine, requests, at_once=True)
    texts = [tokenizer.decode(o, skip_special_tokens=True) for o in outputs]
    valid = []
    for schema, text in zip(SCHEMAS, texts, strict=False):
        try:
            jsonschema.validate(json.loads(text), schema)
            valid.append(True)
        except Exception:
            valid.append(False)
    emit(
        {"guided": texts, "schemas_valid": valid, "regex_matches": bool(re.fullmatch(r"[0-9]{3}-[a-z]{2}", texts[-1]))}
    )


COST = {
    "plain": {},
    "log_probs_top5": {"log_probs": 5},
    "guided_array": {"guide": Guide("json_schema", json.dumps({"type": "array", "items": {"type": "string"}}))},
    "penalties": {"penalties": Penalties(repetition=1.1, presence=0.5, frequency=0.5)},
    "bias": {"embedding_bias": tuple((t, -1.0) for t in range(0, 2000, 7))},
}


def cost(model_dir: Path, prompts: list[list[int]]) -> None:
    for name in ("graphs", "graphs+async"):
        with cuda_engine(model_dir, 64, 512, ENGINES[name]) as engine:
            for batch in (1, 32):
                for case, options in COST.items():
                    request = dict(max_new_tokens=128, end_id=-1, **options)
                    if name == "graphs+async" and case in ("log_probs_top5", "guided_array"):
                        continue  # refused there
                    warm = [GenerationRequest(input_ids=prompts[i % len(prompts)], **request) for i in range(batch)]
                    generated(engine, warm, at_once=True)  # captures this shape's graphs
                    started = time.perf_counter()
                    out = generated(engine, warm, at_once=True)
                    seconds = time.perf_counter() - started
                    emit(
                        {
                            "cost": case,
                            "engine": name,
                            "batch": batch,
                            "tokens_per_s": round(sum(len(o) for o in out) / seconds, 1),
                        }
                    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/gpu_controls"))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    texts = ["Write a story about a dragon.", "List the planets.", "What is 2 + 2?", "Translate 'cat' to French."]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    emit({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__})
    bf16 = make_model(args.work_dir / "bf16", args.tokenizer_dir, "bfloat16")
    agreement(bf16, prompts)
    refusals(bf16, prompts[0])
    guided(bf16, prompts[0])
    log_probs(make_model(args.work_dir / "fp32", args.tokenizer_dir, "float32"), prompts)
    cost(bf16, prompts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
