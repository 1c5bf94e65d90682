"""Integration: generation controls through `ensemble` (HTTP) and `tensorrt_llm_bls` (gRPC streaming).

Each control is checked against a reference: transformers' `generate` with the same processors, a forward
pass of the model for log probabilities, `jsonschema` / `re` for guided output.
"""

from __future__ import annotations

import json
import queue
import re
import urllib.error
import urllib.request
import uuid

import jsonschema
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tritonllm.protocol import infer_inputs, request_tensors

pytestmark = pytest.mark.integration
PROMPT = "List three colours, then say them again."


@pytest.fixture(scope="module")
def urls(server) -> tuple[str, str]:
    return server.http_url, f"{server.host}:{server.grpc_port}"


def ensemble(http_url: str, prompt: str, max_tokens: int, **options) -> dict[str, np.ndarray]:
    with httpclient.InferenceServerClient(http_url, network_timeout=300) as triton:
        result = triton.infer("ensemble", infer_inputs(httpclient, request_tensors(prompt, max_tokens, **options)))
    return {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}


def streamed(grpc_url: str, prompt: str, max_tokens: int, **options) -> list[dict[str, np.ndarray]]:
    """Every response of one tensorrt_llm_bls stream, as {output name: array}."""
    responses: queue.Queue = queue.Queue()
    triton = grpcclient.InferenceServerClient(grpc_url)
    triton.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        tensors = request_tensors(prompt, max_tokens, stream=True, **options)
        triton.async_stream_infer("tensorrt_llm_bls", infer_inputs(grpcclient, tensors), request_id=uuid.uuid4().hex)
        answers = []
        while True:
            result, error = responses.get(timeout=300)
            if error is not None:
                raise error
            outputs = result.get_response().outputs
            answers.append({o.name: result.as_numpy(o.name) for o in outputs})
            if "finish_reason" in answers[-1]:
                return answers
    finally:
        triton.stop_stream()
        triton.close()


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def reference_log_probs(hf_model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at each generated position: [len(generated), vocab]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1)


def test_log_probs_equal_a_reference_forward_pass(urls, tokenizer, hf_model, log_prob_atol):
    http_url, grpc_url = urls
    out = ensemble(http_url, PROMPT, 12, return_log_probs=True, num_top_log_probs=3, end_id=-1)
    answers = streamed(grpc_url, PROMPT, 12, return_log_probs=True, num_top_log_probs=3, end_id=-1)
    ids = [int(t) for a in answers if "output_ids" in a for t in a["output_ids"].reshape(-1)]
    assert len(ids) == 12
    reference = reference_log_probs(hf_model, prompt_ids(tokenizer, PROMPT), ids)
    expected = reference.gather(1, torch.tensor(ids).unsqueeze(1)).squeeze(1).numpy()
    for chosen, top_values, top_ids in (
        (out["output_log_probs"].reshape(-1), out["top_log_probs"].reshape(12, 3), out["top_log_prob_ids"]),
        (
            np.concatenate([a["output_log_probs"].reshape(-1) for a in answers if "output_log_probs" in a]),
            np.concatenate([a["top_log_probs"].reshape(-1, 3) for a in answers if "top_log_probs" in a]),
            np.concatenate([a["top_log_prob_ids"].reshape(-1, 3) for a in answers if "top_log_prob_ids" in a]),
        ),
    ):
        assert np.allclose(chosen, expected, atol=log_prob_atol)
        best = reference.topk(3, dim=-1)
        assert np.allclose(top_values, best.values.numpy(), atol=log_prob_atol)
        assert np.array_equal(top_ids.reshape(12, 3), best.indices.numpy())
    assert np.isclose(float(out["cum_log_probs"].reshape(-1)[0]), expected.sum(), atol=12 * log_prob_atol)
    assert np.isclose(float(answers[-1]["cum_log_probs"].reshape(-1)[0]), expected.sum(), atol=12 * log_prob_atol)


def test_penalties_and_min_tokens_equal_transformers_generate(urls, tokenizer, hf_model):
    http_url, _ = urls
    ids = prompt_ids(tokenizer, PROMPT)
    eos = tokenizer.eos_token_id
    for options, processors in (
        ({"repetition_penalty": 1.5}, {"repetition_penalty": 1.5}),
        ({"min_tokens": 40}, {"min_new_tokens": 40}),
    ):
        generated = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=48, do_sample=False, eos_token_id=eos, pad_token_id=eos, **processors
        )[0, len(ids) :].tolist()
        generated = generated[: generated.index(eos)] if eos in generated else generated
        out = ensemble(http_url, PROMPT, 48, return_log_probs=True, **options)
        # The ensemble answers text; its token count and text must be those of generate's tokens.
        assert out["output_log_probs"].reshape(-1).shape[0] == len(generated), options
        assert out["text_output"].reshape(-1)[0].decode() == tokenizer.decode(generated, skip_special_tokens=True)


def test_presence_penalty_counts_the_prompt_unless_openai_penalties(urls):
    """TensorRT-LLM's rule counts the prompt's tokens, so the penalty already keeps the prompt's words from the
    first token; OpenAI's (openai_penalties) counts the generated ones only, so the first word is the plain one."""
    http_url, _ = urls
    prompt = "one two one two one two one two one"

    def text(**options) -> str:
        return ensemble(http_url, prompt, 4, chat=False, **options)["text_output"].reshape(-1)[0].decode()

    plain = text()
    assert plain.startswith(" two"), plain
    assert not text(presence_penalty=20.0).startswith(" two")
    openai = text(presence_penalty=20.0, openai_penalties=True)
    assert openai.startswith(" two") and openai != plain


def test_an_embedding_bias_of_minus_infinity_keeps_a_word_out(urls):
    http_url, _ = urls
    plain = ensemble(http_url, "What is the capital of France?", 24)["text_output"].reshape(-1)[0].decode()
    assert "Paris" in plain
    biased = ensemble(
        http_url, "What is the capital of France?", 24, embedding_bias={"Paris": float("-inf"), " Paris": float("-inf")}
    )
    assert "Paris" not in biased["text_output"].reshape(-1)[0].decode()


SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}}, "required": ["city"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_output_validates(urls, schema):
    http_url, grpc_url = urls
    guide = {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": json.dumps(schema)}
    whole = ensemble(http_url, "Describe a person or a place as JSON.", 96, **guide)["text_output"]
    deltas = streamed(grpc_url, "Describe a person or a place as JSON.", 96, **guide)
    text = "".join(a["text_output"].reshape(-1)[0].decode() for a in deltas)
    for answer in (whole.reshape(-1)[0].decode(), text):
        jsonschema.validate(json.loads(answer), schema)


def test_regex_and_grammar_outputs_match(urls):
    http_url, _ = urls
    out = ensemble(
        http_url, "When?", 16, guided_decoding_guide_type="regex", guided_decoding_guide=r"[0-9]{4}-[0-9]{2}"
    )
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}", out["text_output"].reshape(-1)[0].decode())
    grammar = 'root ::= "yes" | "no"'
    out = ensemble(http_url, "Is it?", 8, guided_decoding_guide_type="ebnf_grammar", guided_decoding_guide=grammar)
    assert out["text_output"].reshape(-1)[0].decode() in {"yes", "no"}
    assert out["finish_reason"].reshape(-1)[0] == b"eos"
    out = ensemble(http_url, "Give a JSON object.", 48, chat=False, guided_decoding_guide_type="json")
    assert out["finish_reason"].reshape(-1)[0] == b"eos"
    json.loads(out["text_output"].reshape(-1)[0].decode())


def test_counts_come_only_when_asked_and_the_prompt_leads_when_included(urls, tokenizer):
    http_url, _ = urls
    plain = ensemble(http_url, PROMPT, 4)
    assert "num_input_tokens" not in plain and "num_output_tokens" not in plain and "output_log_probs" not in plain
    counted = ensemble(http_url, PROMPT, 4, return_num_input_tokens=True, return_num_output_tokens=True)
    assert int(counted["num_input_tokens"].reshape(-1)[0]) == len(prompt_ids(tokenizer, PROMPT))
    assert int(counted["num_output_tokens"].reshape(-1)[0]) == 4
    included = ensemble(http_url, PROMPT, 4, exclude_input_in_output=False)["text_output"].reshape(-1)[0].decode()
    assert included.endswith(plain["text_output"].reshape(-1)[0].decode()) and PROMPT in included


def post(http_url: str, model: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://{http_url}/v2/models/{model}/generate", method="POST", data=json.dumps(body).encode()
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"beam_width": 2}, "beam_width"),
        ({"lora_task_id": 3}, "lora_task_id"),  # no adapter has this task id (docs/lora.md)
        ({"guided_decoding_guide_type": "regex", "guided_decoding_guide": "[0-9"}, "guided_decoding_guide"),
        ({"num_top_log_probs": 21}, "num_top_log_probs"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ],
)
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_what_cannot_be_honoured_is_a_400_naming_it(urls, model, extra, named):
    http_url, _ = urls
    status, body = post(http_url, model, {"text_input": "Hi.", "max_tokens": 4, **extra})
    assert status == 400 and named in body["error"], body
