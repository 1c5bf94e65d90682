"""The tokenizer file the TensorRT-LLM flavor's guided decoding needs, checked against what 1.2.1 reads.

ModelInstanceState::getGuidedDecodingConfigFromParams (triton_backend/inflight_batcher_llm/src/
model_instance_state.cc) parses it with nlohmann::json and takes `encoded_vocab` as a list of strings,
`tokenizer_str` as a string and `stop_token_ids` as a list of token ids; NVIDIA's
examples/generate_xgrammar_tokenizer_info.py fills them from a Hugging Face tokenizer (the vocabulary
sorted by id, the fast tokenizer's serialization, [eos id]). The same JSON must also be usable by
XGrammar, which the backend hands it to.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tritonllm.trtllm.guided_decoding import (
    GUIDED_DECODING_OFF,
    TOKENIZER_INFO_IN_REPOSITORY,
    GuidedDecodingError,
    GuidedDecodingUnavailable,
    guided_decoding_values,
    tokenizer_info,
    tokenizer_info_json,
)


@pytest.fixture(scope="module")
def info(tokenizer) -> dict:
    return json.loads(tokenizer_info_json(Path(tokenizer.name_or_path), len(tokenizer.get_vocab())))


def test_the_three_keys_with_the_types_the_backend_parses(info):
    assert set(info) == {"encoded_vocab", "tokenizer_str", "stop_token_ids"}
    assert all(isinstance(token, str) for token in info["encoded_vocab"])
    assert isinstance(info["tokenizer_str"], str)
    assert all(isinstance(token_id, int) for token_id in info["stop_token_ids"])


def test_the_content_is_what_nvidias_script_writes(info, tokenizer):
    """Vocabulary sorted by token id, the fast tokenizer's own serialization, and [eos]."""
    assert info["encoded_vocab"] == [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda x: x[1])]
    assert info["tokenizer_str"] == tokenizer.backend_tokenizer.to_str()
    assert json.loads(info["tokenizer_str"])["model"]  # a tokenizer.json document
    assert info["stop_token_ids"] == [tokenizer.eos_token_id]


def test_xgrammar_takes_it_and_compiles_a_grammar_with_it(info, tokenizer):
    xgr = pytest.importorskip("xgrammar")
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(info["tokenizer_str"])
    built = xgr.TokenizerInfo(
        info["encoded_vocab"],
        xgr.VocabType(metadata["vocab_type"]),
        vocab_size=len(info["encoded_vocab"]),
        stop_token_ids=info["stop_token_ids"],
        add_prefix_space=metadata["add_prefix_space"],
    )
    reference = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(info["encoded_vocab"]))
    assert (built.vocab_type, built.add_prefix_space) == (reference.vocab_type, reference.add_prefix_space)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(built).compile_builtin_json_grammar())
    for token_id in tokenizer.encode('{"a": 1}', add_special_tokens=False):
        assert matcher.accept_token(token_id)
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()


class _SlowTokenizer:
    is_fast = False
    eos_token_id = 0

    def get_vocab(self):
        return {"a": 0}


def test_a_tokenizer_without_a_fast_form_is_refused():
    with pytest.raises(GuidedDecodingError, match="no fast form"):
        tokenizer_info(_SlowTokenizer(), 10)


def test_a_tokenizer_larger_than_the_engines_vocabulary_is_refused(tokenizer):
    with pytest.raises(GuidedDecodingError, match="beyond the engine's vocabulary of 100"):
        tokenizer_info(tokenizer, 100)


def test_values_point_inside_the_rendered_repository(tmp_path):
    values = guided_decoding_values(tmp_path / "model_repository" / "tensorrt_llm_decoupled")
    assert values == {
        "guided_decoding_backend": "xgrammar",
        "xgrammar_tokenizer_info_path": str(
            tmp_path.resolve() / "model_repository" / "tensorrt_llm_decoupled" / "1" / "xgrammar_tokenizer_info.json"
        ),
    }
    assert TOKENIZER_INFO_IN_REPOSITORY == "tensorrt_llm/1/xgrammar_tokenizer_info.json"  # the templates' layout


def test_a_tokenizer_without_a_fast_form_leaves_guides_off_rather_than_failing_the_build():
    """Unavailable: the build renders GUIDED_DECODING_OFF; a vocabulary beyond the engine's stays an error."""
    with pytest.raises(GuidedDecodingUnavailable, match="no fast form"):
        tokenizer_info(_SlowTokenizer(), 10)
    assert set(GUIDED_DECODING_OFF) == set(guided_decoding_values(Path("/x")))
    assert set(GUIDED_DECODING_OFF.values()) == {""}, "empty: getGuidedDecodingConfigFromParams returns no config"


def test_a_tokenizer_larger_than_the_engine_is_not_merely_unavailable(tokenizer):
    with pytest.raises(GuidedDecodingError) as err:
        tokenizer_info(tokenizer, 100)
    assert not isinstance(err.value, GuidedDecodingUnavailable)
