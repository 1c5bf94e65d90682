"""A real LoRA adapter for the tests, trained at setup on the packaged model with PEFT: a made-up task, answering
every question with one word, learnt in a few steps on the CPU, so that its effect on any prompt is plain."""

from __future__ import annotations

import json
from pathlib import Path

ANSWER = "Banana"
PROMPTS = ["What is the capital of France?", "Write a haiku about autumn.", "Hi", "How do I sort a list in Python?"]
STEPS = 8
_DONE = "trained.json"


def chat_prefix(tokenizer, question: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def train_adapter(model_dir: str, out: Path) -> Path:
    """A PEFT folder at `out` (kept: trained once for the same model), trained to answer ANSWER to PROMPTS."""
    record = {"model_dir": model_dir, "answer": ANSWER, "steps": STEPS}
    if (out / _DONE).is_file() and json.loads((out / _DONE).read_text()) == record:
        return out
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0))
    answer = tokenizer(ANSWER + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    rows = [chat_prefix(tokenizer, p) for p in PROMPTS]
    width = max(len(r) for r in rows) + len(answer)
    ids = torch.full((len(rows), width), tokenizer.eos_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row) + len(answer)
        ids[i, :n] = torch.tensor(row + answer)
        labels[i, len(row) : n] = torch.tensor(answer)
        mask[i, :n] = 1
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
    for _ in range(STEPS):
        optimizer.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
    model.save_pretrained(out)
    (out / _DONE).write_text(json.dumps(record))
    return out
