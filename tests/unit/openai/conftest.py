"""The OpenAI layer without a server: a small word-level tokenizer, and a stand-in for Triton's gRPC stream
that records each request's tensors and answers with scripted responses."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx2
import numpy as np
import openai
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from tritonclient.utils import deserialize_bytes_tensor, triton_to_np_dtype

from tritonllm.openai.app import create_app
from tritonllm.openai.generation import Generator
from tritonllm.openai.settings import Settings

WORDS = ["<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "Hello", "world", "Paris", "is", "{"]
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MODEL = "tiny"


def make_tokenizer(folder, template: str = CHATML) -> str:
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>")
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return str(folder)


def token(word: str) -> int:
    return WORDS.index(word)


def response(
    text: str = "", tokens=(), log_probs=(), top=None, finish_reason=None, counts=(5, 2), reused_blocks=0
) -> dict:
    """One tensorrt_llm_bls response, shaped as the model returns them; `top` is [(id, log prob), ...] per token."""
    out = {"text_output": np.array([[text.encode()]], dtype=object)}
    if tokens:
        out["output_ids"] = np.array([[list(tokens)]], dtype=np.int32)
        out["output_log_probs"] = np.array([[list(log_probs)]], dtype=np.float32)
    if top:
        out["top_log_probs"] = np.array([[[[p for _, p in t] for t in top]]], dtype=np.float32)
        out["top_log_prob_ids"] = np.array([[[[i for i, _ in t] for t in top]]], dtype=np.int32)
    if finish_reason:
        out["finish_reason"] = np.array([[finish_reason.encode()]], dtype=object)
        out["num_input_tokens"] = np.array([[counts[0]]], dtype=np.int32)
        out["num_output_tokens"] = np.array([[counts[1]]], dtype=np.int32)
        out["kv_cache_reused_blocks"] = np.array([[reused_blocks]], dtype=np.int32)
    return out


def answer_of(*texts: str, finish_reason: str = "eos") -> list[dict]:
    """A text answer in deltas, the last one ending it."""
    return [*(response(t) for t in texts), response(finish_reason=finish_reason)]


class Result:
    def __init__(self, tensors: dict) -> None:
        self.tensors = tensors

    def as_numpy(self, name: str):
        return self.tensors.get(name)


class Stream:
    def __init__(self, triton: FakeTriton, requests) -> None:
        self.triton, self.requests = triton, requests

    async def __aiter__(self):
        async for request in self.requests:
            tensors = {}
            for tensor in request["inputs"]:
                raw = tensor._get_content()
                if tensor.datatype() == "BYTES":
                    value = deserialize_bytes_tensor(raw)
                else:
                    value = np.frombuffer(raw, dtype=triton_to_np_dtype(tensor.datatype()))
                tensors[tensor.name()] = value.reshape(tensor.shape())
            self.triton.requests.append(tensors)
            for out in self.triton.script(tensors):
                await asyncio.sleep(0)
                yield Result(out), None

    def cancel(self) -> None:
        pass


class FakeTriton:
    """tritonclient.grpc.aio's stream_infer: `script(tensors)` gives each request's responses."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.script: Callable[[dict], list[dict]] = lambda tensors: answer_of("Hello", " world")

    def stream_infer(self, requests) -> Stream:
        return Stream(self, requests)

    async def close(self) -> None:
        pass


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def triton() -> FakeTriton:
    return FakeTriton()


def make_layer(tokenizer_dir: str, triton: FakeTriton, **options):
    """call(lambda client: ...): runs a coroutine of an AsyncOpenAI client bound to the app, in-process;
    `options` are Settings fields."""
    settings = Settings("unused:0", tokenizer_dir, MODEL, max_input_len=512, max_seq_len=1024, **options)
    generator = Generator(settings)
    generator._client = triton
    app = create_app(settings, generator)

    def call(function):
        async def main():
            transport = httpx2.ASGITransport(app=app)
            async with httpx2.AsyncClient(transport=transport, base_url="http://test/v1") as http:
                client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
                return await function(client)

        return asyncio.run(main())

    return call


@pytest.fixture
def layer(tokenizer_dir, triton):
    return make_layer(tokenizer_dir, triton)
