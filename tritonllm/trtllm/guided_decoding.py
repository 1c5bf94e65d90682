"""Guided decoding (JSON, JSON schema, regex, EBNF grammar) in the TensorRT-LLM flavor, as release 1.2.1 runs it.

The C++ `tensorrtllm` backend sets up its grammar engine once, when the model loads
(`ModelInstanceState::getGuidedDecodingConfigFromParams`, triton_backend/inflight_batcher_llm/src/
model_instance_state.cc). It reads three parameters of the `tensorrt_llm` model:

- `guided_decoding_backend`: "xgrammar", the only backend the C++ runtime takes (any other value fails the load);
- `xgrammar_tokenizer_info_path`: a JSON file describing the tokenizer to XGrammar (below); it must exist;
- `tokenizer_dir`: read, but unused by the C++ backend (only NVIDIA's Python backend needs it).

Guided decoding is on only when the first two are set (not empty); otherwise the function returns no
config, the executor has no GuidedDecoder, and a request that carries `guided_decoding_guide_type` fails
("GuidedDecoder is not setup").

The JSON file is the one NVIDIA's `examples/generate_xgrammar_tokenizer_info.py` writes for a
Hugging Face tokenizer: an object with
- `encoded_vocab`: every token's string, in token-id order;
- `tokenizer_str`: the fast tokenizer's serialized `tokenizer.json` (from which XGrammar detects how tokens
  encode bytes); the backend reads it unconditionally, so for a tokenizer without one (or without an
  end-of-sequence token) the build renders both parameters empty: the model is served without guides;
- `stop_token_ids`: [the tokenizer's end-of-sequence id].

This module writes the same file itself, with transformers, at build time.
"""

from __future__ import annotations

import json
from pathlib import Path

from tritonllm.errors import ConfigError

BACKEND = "xgrammar"
TOKENIZER_INFO_FILE = "xgrammar_tokenizer_info.json"
# Where the file goes in the rendered model repository: the tensorrt_llm model's version folder.
TOKENIZER_INFO_IN_REPOSITORY = f"tensorrt_llm/1/{TOKENIZER_INFO_FILE}"  # in the templates' layout


# The parameters empty: getGuidedDecodingConfigFromParams returns no config, and the model loads without guides.
GUIDED_DECODING_OFF = {"guided_decoding_backend": "", "xgrammar_tokenizer_info_path": ""}


class GuidedDecodingError(ConfigError):
    """The tokenizer does not fit the engine it is built with; says why."""


class GuidedDecodingUnavailable(GuidedDecodingError):
    """The tokenizer cannot be described to the C++ backend's grammar engine: the model can be served, without
    guides; says why."""


def tokenizer_info(tokenizer, vocab_size: int) -> dict:
    """The `xgrammar_tokenizer_info.json` object for a Hugging Face tokenizer.

    `vocab_size` is the engine's: the grammar engine masks that many logits, so the tokenizer may not
    have more tokens than that.
    """
    if not getattr(tokenizer, "is_fast", False) or getattr(tokenizer, "backend_tokenizer", None) is None:
        raise GuidedDecodingUnavailable(
            f"the tokenizer ({type(tokenizer).__name__}) has no fast form (tokenizer.json): TensorRT-LLM's C++ "
            "backend describes the tokenizer to its grammar engine with that file, so guided decoding cannot run"
        )
    if tokenizer.eos_token_id is None:
        raise GuidedDecodingUnavailable("the tokenizer has no end-of-sequence token: guided decoding needs one to stop")
    by_id = {token_id: token for token, token_id in tokenizer.get_vocab().items()}
    size = max(by_id) + 1
    if size > vocab_size:
        raise GuidedDecodingError(
            f"the tokenizer has token ids up to {size - 1}, beyond the engine's vocabulary of {vocab_size}"
        )
    return {
        # A list indexed by token id: the same as sorting the vocabulary by id when ids have no gaps.
        "encoded_vocab": [by_id.get(token_id, "") for token_id in range(size)],
        "tokenizer_str": tokenizer.backend_tokenizer.to_str(),
        "stop_token_ids": [int(tokenizer.eos_token_id)],
    }


def tokenizer_info_json(tokenizer_dir: Path, vocab_size: int) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return json.dumps(tokenizer_info(tokenizer, vocab_size), ensure_ascii=False)


def guided_decoding_values(engine_folder: Path) -> dict[str, str]:
    """Template values of the TensorRT-LLM flavor's engine config that turn guided decoding on.

    `engine_folder` is where the engine's model will be in the rendered repository; the C++ backend opens the file
    by this absolute path (the container mounts the project at the same path).
    """
    return {
        "guided_decoding_backend": BACKEND,
        "xgrammar_tokenizer_info_path": str(engine_folder.resolve() / "1" / TOKENIZER_INFO_FILE),
    }
