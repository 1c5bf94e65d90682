"""Integration: LoRA adapters by name, on a server built with one (`--lora banana=...`), a real adapter trained at
setup (tests/lora/adapter.py). Its greedy answers must equal PEFT's own generate, token for token, whether asked
by the OpenAI `model`, NVIDIA's `lora_task_id` or `lora_name`, and base requests batched beside them must equal
the base model's. The build turns the prefix cache on, so that a base prompt's kept cells are there to be (not)
shared with the same prompt for the adapter.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import torch
import tritonclient.http as httpclient

from client import infer_inputs, request_tensors
from tests.conftest import BUILD, ROOT, _served, openai_client
from tests.integration.test_controls import post
from tests.integration.test_server import expected_text
from tests.lora.adapter import ANSWER, chat_prefix, train_adapter
from tests.polling import eventually
from tritonllm.launch.tritonserver import metric_samples, metric_value
from tritonllm.protocol import ADMIN_HEADER, LORA_ADAPTERS_OUTPUT, lora_admin_tensors

pytestmark = pytest.mark.integration
ADAPTER = "banana"
LORA_BUILD = BUILD / "lora"
QUESTIONS = ["What is the capital of Germany?", "Write a short poem about the sea."]  # not among its training prompts
MAX_TOKENS = 12
ADMIN_KEY = "lora-admin-key"


@pytest.fixture(scope="module")
def peft_folder(manifest):
    return train_adapter(manifest["model_dir"], BUILD / "lora-adapters" / ADAPTER)


@pytest.fixture(scope="module")
def lora_server(manifest, peft_folder, tmp_path_factory):
    """The default build's model with the adapter, rendered beside it (its converted model shared, not redone)."""
    LORA_BUILD.mkdir(exist_ok=True)
    if not (LORA_BUILD / "models").exists():
        (LORA_BUILD / "models").symlink_to("../models")
    command = [sys.executable, "build_engines.py", "--build-dir", str(LORA_BUILD), "--prefix-cache"]
    command += ["--lora", f"{ADAPTER}={peft_folder}", "--lora-dir", str(peft_folder.parent)]
    subprocess.run(command, cwd=ROOT, check=True)
    yield from _served(LORA_BUILD, tmp_path_factory, admin_key=ADMIN_KEY)


@pytest.fixture(scope="module")
def api(lora_server, tmp_path_factory):
    """Two workers: an adapter one of them loads is served by both."""
    manifest = json.loads((LORA_BUILD / "manifest.json").read_text())
    yield from openai_client(lora_server, manifest, tmp_path_factory, workers=2)


@pytest.fixture(scope="module")
def peft_tokens(manifest, tokenizer, peft_folder) -> dict[str, list[int]]:
    """PEFT's greedy tokens for each question, on a base model of its own (PEFT wraps the model it is given)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(manifest["model_dir"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(peft_folder)).eval()
    eos = tokenizer.eos_token_id
    answers = {}
    for question in QUESTIONS:
        ids = chat_prefix(tokenizer, question)
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=eos)
        tokens = out[0, len(ids) :].tolist()
        answers[question] = tokens[: tokens.index(eos)] if eos in tokens else tokens
    return answers


def test_models_list_the_adapter_with_its_parent(api):
    cards = {card.id: card for card in api.models.list().data}
    base = next(name for name, card in cards.items() if card.parent is None)
    assert cards[ADAPTER].parent == base and set(cards) == {base, ADAPTER}
    assert api.models.retrieve(ADAPTER).parent == base


def test_openai_answers_by_name_mixed_with_base_equal_peft(api, tokenizer, hf_model, peft_tokens):
    """Adapter and base requests at once, whole and streamed: the adapter's equal PEFT's, the base's the base
    model's, and the adapter's effect is there (the base never answers its one word)."""
    base = next(card.id for card in api.models.list().data if card.parent is None)

    def ask(model: str, question: str, stream: bool) -> str:
        messages = [{"role": "user", "content": question}]
        if not stream:
            answer = api.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS)
            assert answer.model == model
            return answer.choices[0].message.content
        chunks = api.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    cases = [(model, q, stream) for model in (ADAPTER, base) for q in QUESTIONS for stream in (False, True)]
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda case: ask(*case), cases))
    base_texts = {q: expected_text(tokenizer, hf_model, q, MAX_TOKENS) for q in QUESTIONS}
    for (model, question, _), text in zip(cases, answers, strict=True):
        if model == ADAPTER:
            assert text == tokenizer.decode(peft_tokens[question], skip_special_tokens=True) == ANSWER
        else:
            assert text == base_texts[question] and ANSWER not in text


def engine_inputs(ids: list[int], **extra) -> list:
    tensors = [
        ("input_ids", np.array([ids], np.int32), "INT32"),
        ("input_lengths", np.array([[len(ids)]], np.int32), "INT32"),
        ("request_output_len", np.array([[MAX_TOKENS]], np.int32), "INT32"),
        ("end_id", np.array([[2]], np.int32), "INT32"),
    ]
    for name, value in extra.items():
        if isinstance(value, str):
            tensors.append((name, np.array([[value.encode()]], dtype=object), "BYTES"))
        else:
            tensors.append((name, np.array([[value]], np.uint64), "UINT64"))
    return infer_inputs(httpclient, tensors)


@pytest.mark.parametrize("chosen", [{"lora_task_id": 1}, {"lora_name": ADAPTER}], ids=["task_id", "name"])
def test_nvidia_inputs_choose_the_adapter_token_for_token(lora_server, tokenizer, peft_tokens, chosen):
    """tensorrt_llm (token ids in and out) and ensemble (text), by task id or by name."""
    question = QUESTIONS[0]
    assert tokenizer.eos_token_id == 2  # the end_id engine_inputs sends
    with httpclient.InferenceServerClient(lora_server.http_url) as triton:
        result = triton.infer("tensorrt_llm", engine_inputs(chat_prefix(tokenizer, question), **chosen))
        length = int(result.as_numpy("sequence_length")[0, 0])
        assert result.as_numpy("output_ids")[0, 0, :length].tolist() == peft_tokens[question]
        tensors = request_tensors(question, MAX_TOKENS, **chosen)
        text = triton.infer("ensemble", infer_inputs(httpclient, tensors)).as_numpy("text_output").reshape(-1)[0]
        assert text.decode() == ANSWER


@pytest.mark.parametrize(
    ("chosen", "named"),
    [({"lora_task_id": 7}, "lora_task_id"), ({"lora_name": "apple"}, "lora_name")],
)
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_an_unknown_adapter_is_a_400_naming_it(lora_server, model, chosen, named):
    status, body = post(lora_server.http_url, model, {"text_input": "Hi", "max_tokens": 4, **chosen})
    assert status == 400 and named in body["error"] and str(next(iter(chosen.values()))) in body["error"], body


def test_an_unknown_model_is_a_404_naming_it(api):
    with pytest.raises(openai.NotFoundError, match="apple"):
        api.chat.completions.create(model="apple", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)


def test_the_prefix_cache_is_never_shared_across_adapters(api):
    """The same prompt for the base, then the adapter twice: the adapter's first is computed afresh (no cached
    tokens, its answer its own), its second reuses its own cells."""
    base = next(card.id for card in api.models.list().data if card.parent is None)
    prompt = "Tell me about the history of the bicycle in a few words."

    def ask(model: str):
        return api.completions.create(model=model, prompt=prompt, max_tokens=4)

    ask(base)
    first, second = ask(ADAPTER), ask(ADAPTER)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert first.choices[0].text == second.choices[0].text


def test_metrics_count_each_adapter_s_requests_and_tokens(lora_server, api):
    """The adapter's counters rise by its own requests and tokens; the base model's requests are not among them."""
    base = next(card.id for card in api.models.list().data if card.parent is None)

    def counters() -> tuple[float, float]:
        samples = metric_samples(lora_server.metrics(timeout=30))
        return tuple(
            metric_value(samples, f"tritonllm_lora_{what}_total", adapter=ADAPTER)
            for what in ("requests", "output_tokens")
        )

    # Earlier tests' requests are counted at the engine model's next tick (every 0.2 s): wait until two reads half a
    # second apart agree.
    for _ in range(20):
        before = counters()
        time.sleep(0.5)
        if counters() == before:
            break
    answer = api.completions.create(model=ADAPTER, prompt="Hi", max_tokens=3)
    api.completions.create(model=base, prompt="Hi", max_tokens=3)
    expected = (before[0] + 1, before[1] + answer.usage.completion_tokens)
    assert eventually(lambda: counters() == expected, timeout=10), (counters(), expected)


def admin(api, action: str, body: dict, key: str | None = ADMIN_KEY) -> tuple[int, str]:
    """vLLM's adapter routes on the OpenAI layer: the status and the body."""
    headers = {ADMIN_HEADER: key} if key is not None else {}
    url = f"{api.base_url}{action}_lora_adapter"
    request = urllib.request.Request(url, json.dumps(body).encode(), {**headers, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_an_adapter_loads_and_unloads_while_serving_with_no_request_lost(api, lora_server):
    """Streams of the base model and of the build's adapter run throughout; the adapter's folder is loaded again as
    `late` (through one worker, served by both), answers as PEFT does, and is unloaded while streams of it run:
    those finish as they would have, every stream ends with a finish reason, and `late` is then a 404."""
    base = next(card.id for card in api.models.list().data if card.parent is None)
    question = [{"role": "user", "content": QUESTIONS[0]}]
    stop = threading.Event()

    def stream(model: str, max_tokens: int = 24, **extra) -> tuple[str, str | None]:
        chunks = api.chat.completions.create(
            model=model, messages=question, max_tokens=max_tokens, stream=True, extra_body=extra
        )
        text, reason = "", None
        for chunk in chunks:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
        return text, reason

    def keep_streaming(model: str) -> list[tuple[str, str | None]]:
        answers = []
        while not stop.is_set():
            answers.append(stream(model))
        return answers

    with ThreadPoolExecutor(8) as pool:
        background = [pool.submit(keep_streaming, model) for model in (base, base, ADAPTER)]
        status, loaded = admin(api, "load", {"lora_name": "late", "lora_path": ADAPTER})
        assert status == 200, loaded
        assert {card["id"]: card["parent"] for card in json.loads(loaded)["data"]}["late"] == base
        for _ in range(4):  # each worker, by the kernel's spread of connections: every one knows `late`
            assert stream("late", MAX_TOKENS)[0] == ANSWER
        late_streams = [pool.submit(stream, "late", 160, ignore_eos=True) for _ in range(2)]  # past its answer
        time.sleep(1.0)  # under way
        assert not any(future.done() for future in late_streams)
        status, unloaded = admin(api, "unload", {"lora_name": "late"})
        assert status == 200, unloaded
        assert "late" not in {card["id"] for card in json.loads(unloaded)["data"]}
        assert all(future.done() for future in late_streams)  # the unload waited for them
        stop.set()
        answers = [a for future in background for a in future.result()] + [f.result() for f in late_streams]
    assert all(reason in ("stop", "length") for _, reason in answers), answers
    assert [f.result()[1] for f in late_streams] == ["length", "length"]
    assert len(answers) > 5
    with pytest.raises(openai.NotFoundError, match="late"):
        api.chat.completions.create(model="late", messages=question, max_tokens=2)
    samples = metric_samples(lora_server.metrics(timeout=30))
    assert metric_value(samples, "tritonllm_lora_requests_total", adapter="late") >= 6


@pytest.mark.parametrize(
    ("action", "body", "key", "status", "said"),
    [
        ("load", {"lora_name": "x", "lora_path": ADAPTER}, None, 401, "tritonllm-admin-key"),
        ("load", {"lora_name": "x", "lora_path": ADAPTER}, "wrong", 401, "tritonllm-admin-key"),
        ("load", {"lora_name": "x", "lora_path": "../.."}, ADMIN_KEY, 400, "lora_path"),
        ("load", {"lora_name": "x", "lora_path": "/etc"}, ADMIN_KEY, 400, "not inside the adapter folder"),
        ("load", {"lora_name": "x", "lora_path": "nothing"}, ADMIN_KEY, 400, "does not exist"),
        ("load", {"lora_name": "x/y", "lora_path": ADAPTER}, ADMIN_KEY, 400, "not an adapter name"),
        ("load", {"lora_name": ADAPTER, "lora_path": ADAPTER}, ADMIN_KEY, 400, "loaded already"),
        ("load", {"lora_name": "x", "lora_path": ADAPTER, "scale": 2}, ADMIN_KEY, 400, "scale"),
        ("unload", {"lora_name": "apple"}, ADMIN_KEY, 400, "no adapter named `apple`"),
    ],
)
def test_adapter_routes_refuse_by_name(api, action, body, key, status, said):
    answer = admin(api, action, body, key)
    assert answer[0] == status and said in answer[1], answer
    assert {card.id for card in api.models.list().data} >= {ADAPTER}


def test_nvidia_clients_load_by_task_id_on_the_engine_model(lora_server, tokenizer, peft_tokens):
    """The engine model takes lora_action itself (Triton's own clients, no OpenAI layer), with the admin key; a
    request without it is refused; the adapter loaded with task id 9 answers by that id on ensemble."""
    import tritonclient.grpc as grpcclient

    def act(*args, **kwargs) -> tuple[list[dict] | None, str | None]:
        answers: queue.Queue = queue.Queue()
        with grpcclient.InferenceServerClient(f"{lora_server.host}:{lora_server.grpc_port}") as triton:
            triton.start_stream(lambda result, error: answers.put((result, error)))
            inputs = infer_inputs(grpcclient, lora_admin_tensors(*args, **kwargs))
            triton.async_stream_infer("tensorrt_llm_decoupled", inputs)
            result, error = answers.get(timeout=120)
            triton.stop_stream()
        if error is not None:
            return None, str(error)
        return json.loads(result.as_numpy(LORA_ADAPTERS_OUTPUT).reshape(-1)[0]), None

    cards, error = act("load", "nine", ADAPTER, task_id=9)
    assert cards is None and "lora_admin_key" in error
    cards, error = act("load", "nine", ADAPTER, task_id=9, admin_key=ADMIN_KEY)
    assert error is None and {"name": "nine", "task_id": 9} in cards
    with httpclient.InferenceServerClient(lora_server.http_url) as triton:
        tensors = request_tensors(QUESTIONS[0], MAX_TOKENS, lora_task_id=9)
        text = triton.infer("ensemble", infer_inputs(httpclient, tensors)).as_numpy("text_output").reshape(-1)[0]
    assert text.decode() == tokenizer.decode(peft_tokens[QUESTIONS[0]], skip_special_tokens=True)
    cards, error = act("unload", "nine", admin_key=ADMIN_KEY)
    assert error is None and "nine" not in {card["name"] for card in cards}
    cards, error = act("list")
    assert error is None and [card["name"] for card in cards] == [ADAPTER]
