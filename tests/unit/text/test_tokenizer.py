"""The serving processes' tokenizer: the class AutoTokenizer picked at build time, loaded without torch."""

import subprocess
import sys

import transformers

from tritonllm.text.tokenizer import load_tokenizer, resolved_class

TEXTS = ["Hello world", "中国的首都是", "<|im_start|>user\n  spaces\tand tabs<|im_end|>"]


def test_the_recorded_class_gives_autotokenizers_tokenizer(manifest, tokenizer):
    recorded = resolved_class(tokenizer)
    assert recorded == f"{type(tokenizer).__name__} transformers=={transformers.__version__}"
    assert manifest["tokenizer_class"] == recorded  # what the build wrote, and the repository's configs render
    loaded = load_tokenizer(manifest["tokenizer_dir"], recorded)
    assert type(loaded) is type(tokenizer)
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert loaded(text)["input_ids"] == ids
        assert loaded.decode(ids) == tokenizer.decode(ids)
    assert loaded.all_special_ids == tokenizer.all_special_ids
    chat = [{"role": "user", "content": "hi"}]
    assert loaded.apply_chat_template(chat, tokenize=False) == tokenizer.apply_chat_template(chat, tokenize=False)


def test_loading_the_recorded_class_imports_no_torch(manifest):
    code = (
        "import sys\n"
        "from tritonllm.text.tokenizer import load_tokenizer\n"
        f"load_tokenizer({manifest['tokenizer_dir']!r}, {manifest['tokenizer_class']!r})('hi')\n"
        "print('torch' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "False"


def test_another_release_or_no_record_lets_autotokenizer_pick(manifest, tokenizer):
    name = type(tokenizer).__name__
    release = f"transformers=={transformers.__version__}"
    for recorded in ("", f"{name} transformers==0.0.1", f"NoSuchTokenizer {release}", f"AutoConfig {release}"):
        loaded = load_tokenizer(manifest["tokenizer_dir"], recorded)
        assert type(loaded) is type(tokenizer)
        assert loaded("Hello world")["input_ids"] == tokenizer("Hello world")["input_ids"]


def test_a_class_transformers_does_not_export_is_not_recorded(tokenizer):
    own = type("OwnTokenizer", (type(tokenizer),), {})  # as a model's own code (trust_remote_code) defines
    assert resolved_class(own.__new__(own)) == ""
