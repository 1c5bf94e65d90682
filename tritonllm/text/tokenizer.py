"""Loading the model's tokenizer in the serving processes without importing torch.

`AutoTokenizer` picks the tokenizer's class through the model's config, and transformers' config module imports
torch, which a tokenizer never uses: in each of the server's text processes (preprocessing, postprocessing,
tensorrt_llm_bls, the OpenAI layer) that import cost ~270 MB of private memory and ~1.5 s of start-up. The build
runs `AutoTokenizer` once and records the class it chose (`resolved_class`); the serving processes load that
class directly (`load_tokenizer`), which gives the same tokenizer, as long as the transformers release is the one
that chose it.
"""

from __future__ import annotations

from typing import Any

# `tokenizer_class` is "<class name> transformers==<release>", or empty: resolve with AutoTokenizer when loading.
_RELEASE = " transformers=="


def resolved_class(tokenizer: Any) -> str:
    """What the build records of the tokenizer `AutoTokenizer` returned: its class, if transformers exports it
    under its own name, and the release that chose it; otherwise empty."""
    import transformers

    name = type(tokenizer).__name__
    if getattr(transformers, name, None) is not type(tokenizer):  # e.g. a model's own code (trust_remote_code)
        return ""
    return f"{name}{_RELEASE}{transformers.__version__}"


def load_tokenizer(tokenizer_dir: str, tokenizer_class: str = "") -> Any:
    """The tokenizer in `tokenizer_dir`: of the class the build recorded when this is the transformers release
    that recorded it, else whatever `AutoTokenizer` picks (a build rendered elsewhere, such as the TensorRT-LLM
    container's preprocessing, or none recorded)."""
    import transformers

    name, _, release = tokenizer_class.partition(_RELEASE)
    cls = getattr(transformers, name, None) if name and release == transformers.__version__ else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase)):
        cls = transformers.AutoTokenizer
    return cls.from_pretrained(tokenizer_dir)
