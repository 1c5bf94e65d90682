"""LoRA adapters: the request rule every front applies, the PEFT -> GGUF conversion, and the llama.cpp engine's
adapted tokens against PEFT's on a random adapter (its q and k rows permuted as llama.cpp's converter writes them)."""

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.polling import eventually
from tests.unit.engine.conftest import chat_ids, submitted
from tritonllm.engine.adapters import BASE, Adapter, AdapterTable, confined
from tritonllm.engine.api import LLAMACPP, EngineConfig, GenerationRequest
from tritonllm.engine.lora_gguf import LoraError, convert_peft, parse_lora, peft_config
from tritonllm.errors import InputError

TABLE = AdapterTable([Adapter("banana", 1, "b.gguf"), Adapter("cherry", 2, "c.gguf")])


@pytest.mark.parametrize(
    ("name", "task_id", "chosen"),
    [(None, None, BASE), ("", None, BASE), ("banana", None, "banana"), (None, 2, "cherry"), ("cherry", 2, "cherry")],
)
def test_a_request_chooses_by_name_or_task_id(name, task_id, chosen):
    assert TABLE.choose(name, task_id) == chosen


@pytest.mark.parametrize(
    ("name", "task_id", "field", "said"),
    [
        ("apple", None, "lora_name", "`apple`"),
        (None, 9, "lora_task_id", "task id 9"),
        ("banana", 2, "lora_task_id", "`cherry`"),
    ],
)
def test_an_unknown_or_contradicting_adapter_is_refused_by_name(name, task_id, field, said):
    with pytest.raises(InputError) as error:
        TABLE.choose(name, task_id)
    assert error.value.field == field and said in str(error.value)
    assert name == "banana" or "`banana` = task 1" in str(error.value)  # an unknown one: those there are, listed


def test_names_and_task_ids_are_one_each():
    with pytest.raises(InputError, match="named `banana`"):
        AdapterTable([Adapter("banana", 1, ""), Adapter("banana", 2, "")])
    with pytest.raises(InputError, match="task id 1"):
        AdapterTable([Adapter("banana", 1, ""), Adapter("cherry", 1, "")])


@pytest.mark.parametrize("spec", ["banana", "banana=", "../x=/tmp/a", "a/b=/tmp/a", ".hidden=/tmp/a"])
def test_a_lora_spec_is_a_name_and_a_path(spec):
    with pytest.raises(LoraError, match="--lora"):
        parse_lora(spec)


@pytest.mark.parametrize(
    "setting", [{"use_dora": True}, {"bias": "all"}, {"modules_to_save": ["lm_head"]}, {"rank_pattern": {"q": 2}}]
)
def test_what_a_gguf_lora_cannot_carry_is_refused_by_name(tmp_path, setting):
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, **setting}))
    with pytest.raises(LoraError, match=next(iter(setting))):
        peft_config(tmp_path)


def test_llama_cpp_with_a_converted_adapter_generates_peft_s_tokens(manifest, tokenizer, tmp_path):
    """A random adapter on every kind of weight the converter maps, q and k among them: llama.cpp's greedy tokens
    equal PEFT's, and differ from the base model's (the adapter is applied)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tritonllm.engine.llamacpp import LlamaCppEngine

    config = manifest["engine_config"]
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(manifest["model_dir"], dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():  # a change the answer shows, small enough that it stays language
        for name, weight in model.named_parameters():
            if "lora_B" in name:
                weight.mul_(0.3)
    model.save_pretrained(tmp_path / "peft")
    adapter = convert_peft("rand", tmp_path / "peft", Path(config["gguf_file"]), tmp_path)
    engine = LlamaCppEngine(
        EngineConfig(
            manifest["model_dir"],
            impl=LLAMACPP,
            gguf_file=config["gguf_file"],
            max_batch_size=4,
            max_seq_len=512,
            kv_cache_tokens=2048,
            lora_adapters=[dataclasses.replace(adapter, task_id=1).as_json()],
        )
    )
    try:
        ids = chat_ids(tokenizer, "What is the capital of Germany?")
        adapted, _ = engine.generate(GenerationRequest(ids, 16, adapter="rand"), timeout=120)
        plain, _ = engine.generate(GenerationRequest(ids, 16), timeout=120)
        model.eval()
        reference = model.generate(
            torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert adapted == reference[0, len(ids) :].tolist() and adapted != plain
        # Submitted together, they share steps (a decode each per step) and still get their own tokens.
        together = [submitted(engine, GenerationRequest(ids, 16, adapter=name)) for name in ("rand", "", "rand")]
        assert all(done.wait(120) for done, _ in together)
        assert [[t for e in emissions for t in e.token_ids] for _, emissions in together] == [adapted, plain, adapted]
        with pytest.raises(InputError, match="lora_name"):
            engine.submit(GenerationRequest(ids, 4, adapter="apple"), lambda emission: None)
        check_loading_while_serving(engine, adapter, ids, adapted)
    finally:
        engine.shutdown()


def check_loading_while_serving(engine, adapter: Adapter, ids: list[int], adapted: list[int]) -> None:
    """The same file loaded again under another name while serving answers the same; unloaded while a request of
    it runs, that request finishes as it would have, new ones are refused at once, and its kept cells go."""
    engine.add_adapter(Adapter("late", 2, adapter.path), timeout=60)
    assert engine.adapters.choose(None, 2) == "late"
    late, _ = engine.generate(GenerationRequest(ids, 16, adapter="late"), timeout=120)
    assert late == adapted
    with pytest.raises(InputError, match="loaded already"):
        engine.add_adapter(Adapter("late", 3, adapter.path), timeout=60)
    running, emissions = submitted(engine, GenerationRequest(ids, 48, adapter="late"))
    unloading = ThreadPoolExecutor(1).submit(engine.remove_adapter, "late", 120)
    assert eventually(lambda: "late" not in engine.adapters.by_name, timeout=10)
    with pytest.raises(InputError, match="no adapter named `late`"):
        engine.submit(GenerationRequest(ids, 4, adapter="late"), lambda emission: None)
    unloading.result(timeout=120)
    assert running.is_set()  # the unload waited for it
    final = emissions[-1]
    assert final.finish_reason == "length" and not final.error
    assert [t for e in emissions for t in e.token_ids][:16] == adapted
    assert "late" not in engine._kept_adapter.values()
    with pytest.raises(InputError, match="lora_name"):
        engine.remove_adapter("late", timeout=10)


def test_a_path_is_confined_to_the_adapter_folder(tmp_path):
    folder = tmp_path / "adapters"
    (folder / "sql").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    (folder / "out").symlink_to(tmp_path / "secret")
    assert confined("sql", str(folder)) == (folder / "sql").resolve()
    assert confined(str(folder / "sql"), str(folder)) == (folder / "sql").resolve()
    for outside in ("../secret", "out", str(tmp_path / "secret"), "", ".", "sql/../.."):
        with pytest.raises(InputError, match=r"lora_path: .* is not inside"):
            confined(outside, str(folder))
    with pytest.raises(InputError, match="does not exist"):
        confined("chat", str(folder))


def test_the_table_gives_the_next_task_id_and_forgets_a_removed_adapter():
    table = AdapterTable([Adapter("banana", 1, "b.gguf"), Adapter("cherry", 5, "c.gguf")])
    assert table.next_task_id() == 6
    table.remove("cherry")
    assert table.cards() == [{"name": "banana", "task_id": 1}] and table.next_task_id() == 2
    with pytest.raises(InputError, match="lora_name: no adapter named `cherry`"):
        table.choose("cherry", None)
    with pytest.raises(InputError, match="lora_name"):
        table.remove("cherry")


def test_lora_is_for_the_llama_cpp_engine_and_the_llm_api_flavor(manifest, capsys):
    """The transformers engine and the TensorRT-LLM engine flavor refuse --lora by name (the C++ backend's own
    lora_task_id, lora_weights and lora_config are declared for its clients instead)."""
    from tritonllm.repository.builder import parse_args
    from tritonllm.repository.plan import BuildError, lora_adapters

    transformers = EngineConfig(manifest["model_dir"], impl="transformers")
    with pytest.raises(BuildError, match=r"llama\.cpp engine"):
        lora_adapters(["a=/nowhere"], transformers, Path(manifest["model_dir"]))
    with pytest.raises(SystemExit):
        parse_args(["--engine", "trtllm", "--lora", "a=/nowhere"])
    assert "--lora is an option of --engine portable" in capsys.readouterr().err
