"""The tokenizer-info file the build writes, read by the xgrammar release that TensorRT-LLM 1.2.1 is built with
(tritonllm.versions.TRTLLM_XGRAMMAR), not the project's own. The C++ runtime hands the file's three fields to
xgrammar's TokenizerInfo (`XGrammarMatcherFactory`, cpp/tensorrt_llm/batch_manager/guidedDecoder.cpp), which
detects from `tokenizer_str` how the tokens encode bytes: xgrammar's own analysis of a Hugging Face
tokenizer.json (C++ `DetectMetadataFromHF`, Python `TokenizerInfo._detect_metadata_from_hf`). A newer
tokenizer.json that this release misreads would make every guide mask the wrong tokens. The release is installed
from the package index into build/tools/ (once) and run in a subprocess."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import BUILD
from tritonllm.trtllm.guided_decoding import tokenizer_info_json
from tritonllm.versions import TRTLLM_XGRAMMAR

CHECK = """
import json, sys
import xgrammar
from xgrammar import TokenizerInfo

assert xgrammar.__file__.startswith(sys.argv[1]), xgrammar.__file__
info, vocab_size, expected = json.load(open(sys.argv[2])), int(sys.argv[3]), json.load(open(sys.argv[4]))
metadata = TokenizerInfo._detect_metadata_from_hf(info["tokenizer_str"])
tokenizer_info = TokenizerInfo(
    info["encoded_vocab"], metadata["vocab_type"], vocab_size=vocab_size,
    stop_token_ids=info["stop_token_ids"], add_prefix_space=metadata["add_prefix_space"],
)
matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(tokenizer_info).compile_json_schema(expected["schema"]))
accepted = [matcher.accept_token(token) for token in expected["ids"] + info["stop_token_ids"]]
decoded = {str(t): tokenizer_info.decoded_vocab[t].decode("utf-8", "replace") for t in map(int, expected["decoded"])}
print(json.dumps({"vocab_type": metadata["vocab_type"].name, "accepted": accepted,
                  "terminated": matcher.is_terminated(), "decoded": decoded}))
"""


@pytest.fixture(scope="module")
def release_xgrammar() -> Path:
    target = BUILD / "tools" / f"xgrammar-{TRTLLM_XGRAMMAR}"
    if not (target / "xgrammar").is_dir():
        partial = target.with_name(target.name + ".partial")
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps"]
        subprocess.run([*pip, "--target", str(partial), f"xgrammar=={TRTLLM_XGRAMMAR}"], check=True)
        partial.rename(target)
    return target


def test_the_release_xgrammar_reads_the_tokenizer_info_the_build_writes(release_xgrammar, manifest, tmp_path):
    """Byte-level tokens (SmolLM2's, as GPT-2's) are detected as such, decode to the tokenizer's own text, and a
    JSON schema's compiled grammar accepts the tokens of a matching document, then the end id."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(manifest["tokenizer_dir"])
    info = tmp_path / "info.json"
    info.write_text(tokenizer_info_json(Path(manifest["tokenizer_dir"]), manifest["vocab_size"]))
    ids = tokenizer.encode('{"city": "Paris"}', add_special_tokens=False)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    expected = tmp_path / "expected.json"
    expected.write_text(json.dumps({"schema": json.dumps(schema), "ids": ids, "decoded": ids}))
    env = {**os.environ, "PYTHONPATH": str(release_xgrammar)}
    out = subprocess.run(
        [sys.executable, "-c", CHECK, str(release_xgrammar), str(info), str(manifest["vocab_size"]), str(expected)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["vocab_type"] == "BYTE_LEVEL"
    assert result["decoded"] == {str(t): tokenizer.decode([t]) for t in ids}
    assert all(result["accepted"]) and result["terminated"]
