"""Integration: a real tritonserver with the built repository, driven over HTTP with tritonclient.

No mock of Triton or of the model: greedy text must equal what transformers' `generate`
produces for the same model, prompt and max tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient

from client import GenerationError, generate, infer_inputs, request_tensors
from tests.conftest import ROOT
from tritonllm.launch.tritonserver import metric_samples, metric_value
from tritonllm.protocol import KV_CACHE_OUTPUTS, MAX_WORDS
from tritonllm.text.detokenization import REPLACEMENT, Detokenizer

pytestmark = pytest.mark.integration
PROMPTS = ["What is the capital of France?", "中国的首都是哪里？", "Write a haiku about autumn."]


def expected_text(tokenizer, hf_model, prompt: str, max_tokens: int, chat: bool = True) -> str:
    """What the ensemble must answer: transformers' greedy tokens, decoded by our detokenizer rules."""
    if chat:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    else:
        ids = tokenizer(prompt)["input_ids"]
    eos = tokenizer.eos_token_id
    out = hf_model.generate(
        torch.tensor([list(ids)]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos
    )[0, len(ids) :].tolist()
    return Detokenizer(tokenizer).decode(out[: out.index(eos)] if eos in out else out)


@pytest.fixture(scope="module")
def url(server) -> str:
    return server.http_url


def test_all_models_ready(url, manifest):
    with httpclient.InferenceServerClient(url) as triton:
        assert triton.is_server_ready()
        for name in manifest["models"]:
            assert triton.is_model_ready(name), name
        config = triton.get_model_config("ensemble")
        assert not config.get("model_transaction_policy", {}).get("decoupled", False)


def loads_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return any("libtorch_cpu" in line for line in maps)


def test_the_text_models_load_no_torch(server):
    """Tokenizing and detokenizing need no torch (tritonllm/text/tokenizer.py): it would take ~270 MB and ~1.5 s
    of start-up in each of these processes."""
    pids = subprocess.run(["pgrep", "-P", str(server.process.pid)], capture_output=True, text=True).stdout.split()
    stubs = {}
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            model = next(
                (arg.split(b"/")[-3] for arg in cmdline.read().split(b"\0") if arg.endswith(b"/model.py")), b""
            )
        stubs[int(pid)] = model.decode()
    text_models = {
        pid: model for pid, model in stubs.items() if model in ("preprocessing", "postprocessing", "tensorrt_llm_bls")
    }
    assert sorted(set(text_models.values())) == ["postprocessing", "preprocessing", "tensorrt_llm_bls"], stubs
    assert [model for pid, model in text_models.items() if loads_torch(pid)] == []


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_text_equals_transformers_generate(url, tokenizer, hf_model, prompt):
    assert generate(prompt, 24, url=url) == expected_text(tokenizer, hf_model, prompt, 24)


def test_raw_prompt_without_chat_template(url, tokenizer, hf_model):
    prompt = "The three primary colors are"
    assert generate(prompt, 16, url=url, chat=False) == expected_text(tokenizer, hf_model, prompt, 16, chat=False)


def test_engine_tokens_equal_generate(url, tokenizer, hf_model):
    """The engine's own output ids, token for token, through the request/response bridge."""
    ids = tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]
    inputs = []
    for name, value, datatype in (
        ("input_ids", np.array([ids], np.int32), "INT32"),
        ("input_lengths", np.array([[len(ids)]], np.int32), "INT32"),
        ("request_output_len", np.array([[12]], np.int32), "INT32"),
    ):
        tensor = httpclient.InferInput(name, list(value.shape), datatype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    with httpclient.InferenceServerClient(url) as triton:
        result = triton.infer("tensorrt_llm", inputs)
    length = int(result.as_numpy("sequence_length")[0, 0])
    tokens = result.as_numpy("output_ids")[0, 0, :length].tolist()
    reference = hf_model.generate(
        torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(ids) :].tolist()
    assert tokens == reference


def test_ensemble_finish_reasons(url):
    with httpclient.InferenceServerClient(url) as triton:
        cut = triton.infer(
            "ensemble", infer_inputs(httpclient, request_tensors(PROMPTS[0], 3, return_num_output_tokens=True))
        )
        whole = triton.infer(
            "ensemble", infer_inputs(httpclient, request_tensors(PROMPTS[0], 64, return_num_output_tokens=True))
        )
    assert (cut.as_numpy("finish_reason")[0], cut.as_numpy("num_output_tokens")[0, 0]) == (b"length", 3)
    assert whole.as_numpy("finish_reason")[0] == b"eos" and whole.as_numpy("num_output_tokens")[0, 0] < 64


def test_the_engine_leaves_the_end_id_out_of_its_output(url, tokenizer):
    """As TensorRT-LLM's executor does: so postprocessing cannot see the end id, and infers "eos" from an early end."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    inputs = [
        _tensor("input_ids", np.array([ids], np.int32), "INT32"),
        _tensor("input_lengths", np.array([[len(ids)]], np.int32), "INT32"),
        _tensor("request_output_len", np.array([[64]], np.int32), "INT32"),
        _tensor("end_id", np.array([[tokenizer.eos_token_id]], np.int32), "INT32"),
    ]
    with httpclient.InferenceServerClient(url) as triton:
        result = triton.infer("tensorrt_llm", inputs)
    length = int(result.as_numpy("sequence_length")[0, 0])
    assert 0 < length < 64
    assert tokenizer.eos_token_id not in result.as_numpy("output_ids")[0, 0, :length].tolist()


def test_concurrent_requests_all_answered_correctly(url, tokenizer, hf_model):
    prompts = [f"Give one word that rhymes with number {i}." for i in range(10)]
    expected = [expected_text(tokenizer, hf_model, p, 12) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: generate(p, 12, url=url), prompts))
    assert answers == expected


@pytest.mark.parametrize("max_tokens", range(1, 9))
def test_cut_multibyte_character_is_dropped(url, max_tokens):
    text = generate("请用中文介绍一下长城。", max_tokens, url=url)
    assert REPLACEMENT not in text


def test_seeded_sampling_repeats(url):
    options = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    first = generate("Write a short poem.", 16, url=url, **options)
    assert generate("Write a short poem.", 16, url=url, **options) == first


def test_stop_words_cut_the_text(url):
    full = generate("What is the capital of France?", 24, url=url)
    assert "Paris" in full
    stopped = generate("What is the capital of France?", 24, url=url, stop=["Paris"])
    assert stopped == full[: full.index("Paris")]


@pytest.mark.parametrize("count", [17, MAX_WORDS])
def test_up_to_the_word_limit_stop_and_bad_words_reach_the_engine(url, count):
    """Preprocessing sends each word twice (alone and after a space): the engine takes that many sequences."""
    prompt = "What is the capital of France?"
    fillers = [f"zqx{i}" for i in range(count - 1)]  # never generated; each call sends `count` words per list
    plain = generate(prompt, 24, url=url, stop=[*fillers, "zqxlast"], bad_words=[*fillers, "zqxlast"])
    assert "Paris" in plain
    assert "Paris" not in generate(prompt, 24, url=url, stop=[*fillers, "zqxlast"], bad_words=[*fillers, "Paris"])
    stopped = generate(prompt, 24, url=url, stop=[*fillers, "Paris"], bad_words=[*fillers, "zqxlast"])
    assert stopped == plain[: plain.index("Paris")]


@pytest.mark.parametrize("field", ["stop_words", "bad_words"])
def test_one_word_over_the_limit_is_refused_by_its_client_name(url, field):
    words = {"stop": [], "bad_words": []}
    words["stop" if field == "stop_words" else "bad_words"] = [f"zqx{i}" for i in range(MAX_WORDS + 1)]
    with pytest.raises(GenerationError) as refused:
        generate("hi", 4, url=url, **words)
    message = str(refused.value)
    assert f"{field}: {MAX_WORDS + 1} words, more than the limit of {MAX_WORDS}" in message
    assert "_list" not in message and int(refused.value.status) == 400


def _infer_raw(url: str, inputs: list) -> tuple[int, str]:
    """Status and message of an /infer call built by hand (so that any tensor can be malformed)."""
    with httpclient.InferenceServerClient(url) as triton:
        try:
            triton.infer("ensemble", inputs)
        except Exception as exc:  # tritonclient raises InferenceServerException
            return int(exc.status() or 0), exc.message()
    return 200, ""


def _tensor(name, value, datatype):
    tensor = httpclient.InferInput(name, list(value.shape), datatype)
    tensor.set_data_from_numpy(value)
    return tensor


def _text(s: bytes | str) -> np.ndarray:
    return np.array([[s if isinstance(s, bytes) else s.encode()]], dtype=object)


BAD_INPUTS = {
    "empty text_input": ([_text(""), 8], "text_input"),
    "max_tokens zero": ([_text("hi"), 0], "max_tokens"),
    "max_tokens negative": ([_text("hi"), -4], "max_tokens"),
    "max_tokens over the limit": ([_text("hi"), 10**6], "max_tokens"),
    "prompt over the input limit": ([_text("hello " * 4000), 8], "text_input"),
    "invalid UTF-8": ([_text(b"\xff\xfe\xfd"), 8], "text_input"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_a_clear_400(url, case):
    (text, max_tokens), field = BAD_INPUTS[case]
    status, message = _infer_raw(
        url, [_tensor("text_input", text, "BYTES"), _tensor("max_tokens", np.array([[max_tokens]], np.int32), "INT32")]
    )
    assert status == 400, (status, message)
    assert field in message


@pytest.mark.parametrize(
    ("name", "value", "datatype", "field"),
    [
        ("temperature", np.array([[-1.0]], np.float32), "FP32", "temperature"),
        ("temperature", np.array([[np.nan]], np.float32), "FP32", "temperature"),
        ("top_p", np.array([[-0.5]], np.float32), "FP32", "top_p"),  # 0 is unset, as in TensorRT-LLM
        ("top_k", np.array([[-3]], np.int32), "INT32", "top_k"),
        ("end_id", np.array([[10**7]], np.int32), "INT32", "end_id"),
        ("max_tokens_typo", np.array([[1]], np.int32), "INT32", "max_tokens_typo"),
    ],
)
def test_bad_optional_input_is_a_clear_400(url, name, value, datatype, field):
    inputs = [
        _tensor("text_input", _text("hi"), "BYTES"),
        _tensor("max_tokens", np.array([[4]], np.int32), "INT32"),
        _tensor(name, value, datatype),
    ]
    status, message = _infer_raw(url, inputs)
    assert status == 400, (status, message)
    assert field in message


def test_missing_max_tokens_and_wrong_type(url):
    status, message = _infer_raw(url, [_tensor("text_input", _text("hi"), "BYTES")])
    assert status == 400 and "max_tokens" in message
    status, message = _infer_raw(
        url, [_tensor("text_input", _text("hi"), "BYTES"), _tensor("max_tokens", np.array([[4.0]], np.float32), "FP32")]
    )
    assert status == 400 and "max_tokens" in message


def test_still_ready_and_same_answers_after_bad_input(url, tokenizer, hf_model):
    with httpclient.InferenceServerClient(url) as triton:
        assert triton.is_server_ready()
    assert generate(PROMPTS[0], 24, url=url) == expected_text(tokenizer, hf_model, PROMPTS[0], 24)


def test_generate_error_carries_the_server_message(url):
    with pytest.raises(GenerationError, match="max_tokens"):
        generate("hi", 0, url=url)


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{url}{path}", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_http_generate_endpoint(url):
    body = {"text_input": PROMPTS[0], "max_tokens": 24, "apply_chat_template": True}
    status, answer = _post(url, "/v2/models/ensemble/generate", body)
    assert status == 200
    assert answer["text_output"] == generate(PROMPTS[0], 24, url=url)
    status, answer = _post(url, "/v2/models/ensemble/generate", {"text_input": "hi", "max_tokens": 0})
    assert status == 400 and "max_tokens" in answer["error"]


def test_client_cli(url):
    def run(*args):
        command = [sys.executable, "-m", "client", "--url", url, *args]
        return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)

    ok = run("-n", "24", PROMPTS[0])
    assert ok.returncode == 0 and ok.stdout.strip() == generate(PROMPTS[0], 24, url=url)
    bad = run("-n", "0", "hi")
    assert bad.returncode == 1 and "max_tokens" in bad.stderr


def test_request_tensors_only_send_what_is_given():
    names = [name for name, _, _ in request_tensors("hi", 4)]
    assert names == ["text_input", "max_tokens", "apply_chat_template"]
    names = [name for name, _, _ in request_tensors("hi", 4, temperature=0.5, seed=3, stop=["x"])]
    assert {"temperature", "seed", "stop_words"} <= set(names)


def scrape(server) -> dict[str, float]:
    """The tritonllm_* samples of the metrics port, keyed by their text (name and labels)."""
    return metric_samples(server.metrics(timeout=30))


def test_metrics_add_up_after_traffic(server, url, manifest):
    import time

    time.sleep(0.6)  # the engine flushes its metrics every 0.2 s: an earlier test's last request is counted by now
    before = scrape(server)
    lengths = [3, 5, 8]
    answers = []
    with httpclient.InferenceServerClient(url) as triton:
        for n in lengths:
            tensors = request_tensors("Count to ten.", n, return_num_input_tokens=True, return_perf_metrics=True)
            inputs = [_tensor(name, value, dt) for name, value, dt in tensors]
            inputs.append(_tensor("end_id", np.array([[-1]], np.int32), "INT32"))
            answers.append(triton.infer("ensemble", inputs))
        bad = [  # refused by the engine itself (a token id outside the vocabulary): an engine-level error
            _tensor("input_ids", np.array([[10**6]], np.int32), "INT32"),
            _tensor("input_lengths", np.array([[1]], np.int32), "INT32"),
            _tensor("request_output_len", np.array([[4]], np.int32), "INT32"),
        ]
        with pytest.raises(Exception, match="input_ids"):
            triton.infer("tensorrt_llm", bad)
    time.sleep(0.6)  # the engine flushes its metrics every 0.2 s
    after = scrape(server)
    finished = metric_value(after, "tritonllm_requests_finished_total")
    assert finished and metric_value(after, "tritonllm_requests_finished_total", device="cpu") == finished
    delta = {
        name: metric_value(after, name) - metric_value(before, name)
        for name in (
            "tritonllm_requests_finished_total",
            "tritonllm_output_tokens_total",
            "tritonllm_input_tokens_total",
            "tritonllm_time_to_first_token_seconds_count",
            "tritonllm_time_per_output_token_seconds_count",
            "tritonllm_prefix_cache_tokens_total",
        )
    }
    assert delta["tritonllm_requests_finished_total"] == len(lengths)
    assert metric_value(after, "tritonllm_requests_finished_total", finish_reason="length") - metric_value(
        before, "tritonllm_requests_finished_total", finish_reason="length"
    ) == len(lengths)
    assert delta["tritonllm_output_tokens_total"] == sum(lengths)
    assert delta["tritonllm_input_tokens_total"] == sum(int(a.as_numpy("num_input_tokens")[0, 0]) for a in answers)
    prompt = int(answers[0].as_numpy("num_input_tokens")[0, 0])
    if manifest["engine_config"].get("prefix_cache"):  # the repeats start from the first one's cache, at least
        assert (len(lengths) - 1) * (prompt - 1) <= delta["tritonllm_prefix_cache_tokens_total"] < len(lengths) * prompt
    else:
        assert delta["tritonllm_prefix_cache_tokens_total"] == 0
    # Each request's own count (TensorRT-LLM's perf metrics, blocks of one token) adds up to the counter's.
    blocks = [{name: int(a.as_numpy(name)[0, 0]) for name in KV_CACHE_OUTPUTS} for a in answers]
    assert sum(b["kv_cache_reused_blocks"] for b in blocks) == delta["tritonllm_prefix_cache_tokens_total"]
    assert [b["kv_cache_alloc_total_blocks"] for b in blocks] == [prompt + n - 1 for n in lengths]
    assert all(
        b["kv_cache_alloc_new_blocks"] + b["kv_cache_reused_blocks"] == prompt + n - 1
        for b, n in zip(blocks, lengths, strict=True)
    )
    assert delta["tritonllm_time_to_first_token_seconds_count"] == len(lengths)
    assert delta["tritonllm_time_per_output_token_seconds_count"] == len(lengths)
    errors = {
        k: metric_value(after, "tritonllm_request_errors_total", kind=k)
        - metric_value(before, "tritonllm_request_errors_total", kind=k)
        for k in ("invalid_input", "server_busy", "generation_failed")
    }
    assert errors == {"invalid_input": 1, "server_busy": 0, "generation_failed": 0}
    assert metric_value(after, "tritonllm_engine_requests_in_flight") == 0
    assert metric_value(after, "tritonllm_engine_requests", state="running") == 0
    assert "tritonllm_cuda_graphs" in {k.split("{")[0] for k in after}  # exported; none captured on a CPU
    assert metric_value(after, "tritonllm_cuda_graphs") == 0
