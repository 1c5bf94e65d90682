"""Text to the engine's inputs: prompt ids, lengths, end/pad ids and stop/bad word lists.

Inputs and outputs use the names of NVIDIA's reference `preprocessing` model. The tensors are read and checked
with wire.py's rules, the ones every entry point applies, so a bad request fails fast with a message naming the
input and its limit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tritonllm.engine.checks import check_sampling
from tritonllm.engine.grammar_check import check_guide
from tritonllm.errors import InputError
from tritonllm.protocol import MAX_BIASED_TOKENS, MAX_WORD_BYTES, MAX_WORDS
from tritonllm.text.wire import (
    Limits,
    as_text,
    check_beam_width,
    parse_guide,
    scalar,
    word_list,
)

MAX_BYTES_PER_TOKEN = 64  # no tokenizer we know packs more bytes into one token
# Who checks a guide before generation (preprocessing's guided_decoding parameter; Preprocessor says what each is).
GUIDES_BY_ENGINE, GUIDES_COMPILED, GUIDES_OFF = "engine", "compile", "off"
GUIDE_MODES = (GUIDES_BY_ENGINE, GUIDES_COMPILED, GUIDES_OFF)


class Preprocessor:
    """Tokenizes every row of every request in one call to the fast tokenizer."""

    def __init__(
        self,
        tokenizer,
        limits: Limits,
        add_special_tokens: bool = True,
        max_beam_width: int = 1,
        guides: str = GUIDES_BY_ENGINE,
    ) -> None:
        """`guides`: GUIDES_BY_ENGINE (the engine compiles them as requests arrive), GUIDES_COMPILED (compiled here
        first: TensorRT-LLM compiles them in its batch step, tritonllm/engine/grammar_check.py), or GUIDES_OFF
        (the engine has none: a TensorRT-LLM engine whose tokenizer its grammar engine cannot read)."""
        if guides not in GUIDE_MODES:
            raise ValueError(f"guided_decoding must be one of {', '.join(GUIDE_MODES)}, got {guides!r}")
        self.tokenizer = tokenizer
        self.limits = limits
        self.max_beam_width = max_beam_width
        self.guides = guides
        self.add_special_tokens = add_special_tokens
        self.end_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else -1
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.end_id
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))

    def _prompt(self, arrays: dict[str, np.ndarray], row: int) -> tuple[str, bool]:
        """The text to tokenize, and whether the chat template made it."""
        if scalar(arrays, "STREAM", row):
            raise InputError(
                "stream",
                "the `ensemble` model answers once in this deployment (NVIDIA's decoupled_mode false); to stream, "
                "call `tensorrt_llm_bls` with gRPC streaming or POST /v2/models/tensorrt_llm_bls/generate_stream, "
                "or build with --decoupled-mode, where `ensemble` streams over gRPC",
            )
        query = arrays.get("QUERY")
        if query is None:
            raise InputError("text_input", "is required")
        raw = query.reshape(query.shape[0], -1)[row, 0]
        if isinstance(raw, bytes) and len(raw) > MAX_BYTES_PER_TOKEN * self.limits.max_input_len:
            # Refused before tokenizing: a multi-megabyte prompt would hold the tokenizer for seconds.
            raise InputError(
                "text_input",
                f"{len(raw)} bytes, more than any prompt within the maximum input length of "
                f"{self.limits.max_input_len} tokens",
            )
        text = as_text(raw, "text_input")
        if not text.strip():
            raise InputError("text_input", "is empty")
        if scalar(arrays, "APPLY_CHAT_TEMPLATE", row):
            if not self.has_chat_template:
                raise InputError("apply_chat_template", "this model's tokenizer has no chat template")
            chat = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            return chat, True
        return text, False

    def _words(self, arrays: dict[str, np.ndarray], name: str, field: str, row: int) -> list[str]:
        array = arrays.get(name)
        if array is None:
            return []
        values = array.reshape(array.shape[0], -1)[row].tolist()
        words = [as_text(v, field) for v in values]
        words = [w for w in words if w != ""]  # empty strings mean "none" (reference clients send "")
        if len(words) > MAX_WORDS:
            raise InputError(field, f"{len(words)} words, more than the limit of {MAX_WORDS}")
        for word in words:
            if len(word.encode()) > MAX_WORD_BYTES:
                raise InputError(field, f"a word is {len(word.encode())} bytes, over the limit of {MAX_WORD_BYTES}")
        return words

    def _word_ids(self, words: list[str]) -> list[list[int]]:
        """Token sequences of each word, alone and after a space: mid-sentence, most tokenizers
        spell a word with its leading space, so " Paris" is the sequence a model generates."""
        variants = list(dict.fromkeys(v for w in words for v in (w, w if w[0].isspace() else " " + w)))
        if not variants:
            return []
        return [ids for ids in self.tokenizer(variants, add_special_tokens=False)["input_ids"] if ids]

    def _embedding_bias(self, arrays: dict[str, np.ndarray], row: int) -> np.ndarray | None:
        """The [vocab] biases of one row: each token of each embedding_bias_words word gets its weight (as NVIDIA's
        preprocessing adds them), and each logit_bias_token_ids id its weight; None when the row gives none."""
        pairs: list[tuple[list[int], float]] = []
        for ids_name, weights_name, field, weights_field in (
            ("EMBEDDING_BIAS_WORDS", "EMBEDDING_BIAS_WEIGHTS", "embedding_bias_words", "embedding_bias_weights"),
            ("LOGIT_BIAS_TOKEN_IDS", "LOGIT_BIAS_WEIGHTS", "logit_bias_token_ids", "logit_bias_weights"),
        ):
            keys, weights = _row_values(arrays.get(ids_name), row), _row_values(arrays.get(weights_name), row)
            if len(keys) != len(weights):
                raise InputError(
                    weights_field, f"needs one weight per entry of {field}: got {len(keys)} and {len(weights)}"
                )
            if len(keys) > MAX_BIASED_TOKENS:
                raise InputError(field, f"{len(keys)} entries, more than the limit of {MAX_BIASED_TOKENS}")
            for weight in weights:
                if math.isnan(weight) or weight == math.inf:
                    raise InputError(weights_field, f"must be finite numbers or -inf (a ban), got {weight}")
            if ids_name == "LOGIT_BIAS_TOKEN_IDS":
                for token in keys:
                    if not 0 <= token < self.limits.vocab_size:
                        raise InputError(field, f"token ids must be in [0, {self.limits.vocab_size}), got {token}")
                pairs += [([int(t)], float(w)) for t, w in zip(keys, weights, strict=True)]
            else:
                words = [as_text(w, field) for w in keys]
                for word in words:
                    if len(word.encode()) > MAX_WORD_BYTES:
                        raise InputError(
                            field, f"a word is {len(word.encode())} bytes, over the limit of {MAX_WORD_BYTES}"
                        )
                encoded = self.tokenizer(words, add_special_tokens=False)["input_ids"] if words else []
                pairs += [(ids, float(w)) for ids, w in zip(encoded, weights, strict=True)]
        if not pairs:
            return None
        bias = np.zeros(self.limits.vocab_size, dtype=np.float32)
        for ids, weight in pairs:
            np.add.at(bias, [t for t in ids if t < self.limits.vocab_size], weight)
        return bias

    def _token_id(self, arrays: dict[str, np.ndarray], name: str, field: str, row: int, default: int) -> int:
        value = scalar(arrays, name, row)
        if value is None:
            return default
        if not -1 <= value < self.limits.vocab_size:
            raise InputError(field, f"must be -1 or a token id below {self.limits.vocab_size}, got {value}")
        return int(value)

    def tokenize_prompt(self, text: str) -> list[int]:
        """A prompt's tokens as `process` makes them for a `text_input` sent without the chat template."""
        return self.tokenizer([text], add_special_tokens=self.add_special_tokens)["input_ids"][0]

    def process(
        self, requests: Sequence[dict[str, np.ndarray]], known_ids: Sequence[list[int] | None] = ()
    ) -> list[dict[str, np.ndarray] | InputError]:
        """One result per request: its output tensors, or the InputError that rejects it. `known_ids[i]`, when
        given: request i's prompt as `tokenize_prompt` made it already (a one-row request without the chat
        template), so it is not tokenized twice; or, for a request without `text_input`, its prompt in tokens."""
        # Prompts of all requests, split by whether the chat template (which writes its own
        # special tokens) was applied; each group is tokenized in one call.
        groups: dict[bool, tuple[list[tuple[int, int]], list[str]]] = {False: ([], []), True: ([], [])}
        results: list[dict[str, np.ndarray] | InputError] = []
        per_request: dict[int, dict[int, list[int]]] = {}
        for index, arrays in enumerate(requests):
            known = known_ids[index] if index < len(known_ids) else None
            if known is not None and "QUERY" not in arrays:  # a request in tokens (a Dynamo worker's): no text
                results.append({})
                per_request[index] = {0: known}
                continue
            try:
                batch = arrays["QUERY"].shape[0] if "QUERY" in arrays else 1
                prompts = [self._prompt(arrays, row) for row in range(batch)]
            except InputError as exc:
                results.append(exc)
                continue
            results.append({})
            if known is not None and len(prompts) == 1 and not prompts[0][1]:
                per_request[index] = {0: known}
                continue
            for row, (text, chat) in enumerate(prompts):
                groups[chat][0].append((index, row))
                groups[chat][1].append(text)
        for chat, (keys, texts) in groups.items():
            if texts:
                add_special = self.add_special_tokens and not chat
                for (index, row), ids in zip(
                    keys, self.tokenizer(texts, add_special_tokens=add_special)["input_ids"], strict=True
                ):
                    per_request.setdefault(index, {})[row] = ids
        for index, arrays in enumerate(requests):
            if isinstance(results[index], InputError):
                continue
            try:
                prompts = per_request[index]
                results[index] = self._outputs(arrays, [prompts[row] for row in sorted(prompts)])
            except InputError as exc:
                results[index] = exc
        return results

    def _outputs(self, arrays: dict[str, np.ndarray], prompts: list[list[int]]) -> dict[str, np.ndarray]:
        limits = self.limits
        lengths, output_lens, end_ids, pad_ids, stops, bads, biases = [], [], [], [], [], [], []
        for row, ids in enumerate(prompts):
            if len(ids) > limits.max_input_len:
                raise InputError(
                    "text_input",
                    f"the prompt is {len(ids)} tokens, over the maximum input length of {limits.max_input_len}",
                )
            max_tokens = scalar(arrays, "REQUEST_OUTPUT_LEN", row)
            if max_tokens is None:
                raise InputError("max_tokens", "is required")
            room = limits.max_seq_len - len(ids)
            if not 1 <= max_tokens <= room:
                raise InputError(
                    "max_tokens",
                    f"must be between 1 and {room} for this prompt of {len(ids)} tokens "
                    f"(max sequence length {limits.max_seq_len}), got {max_tokens}",
                )
            check_sampling(
                scalar(arrays, "TEMPERATURE", row), scalar(arrays, "TOP_K", row), scalar(arrays, "TOP_P", row)
            )
            beam_width = scalar(arrays, "BEAM_WIDTH", row)
            check_beam_width(beam_width, self.max_beam_width)
            guide = parse_guide(
                scalar(arrays, "GUIDED_DECODING_GUIDE_TYPE", row), scalar(arrays, "GUIDED_DECODING_GUIDE", row)
            )
            if guide is not None and (beam_width or 1) > 1:  # TensorRT-LLM's grammar follows the first beam only
                raise InputError("beam_width", f"guided decoding generates one beam: it must be 1, got {beam_width}")
            if guide is not None and self.guides == GUIDES_OFF:
                raise InputError(
                    "guided_decoding_guide_type",
                    "this model's engine has no guided decoding (its tokenizer has no fast form for the grammar "
                    "engine; the build said so)",
                )
            if guide is not None and self.guides == GUIDES_COMPILED:
                check_guide(*guide)
            lengths.append(len(ids))
            output_lens.append(max_tokens)
            end_ids.append(self._token_id(arrays, "END_ID", "end_id", row, self.end_id))
            pad_ids.append(self._token_id(arrays, "PAD_ID", "pad_id", row, self.pad_id))
            stops.append(word_list(self._word_ids(self._words(arrays, "STOP_WORDS_DICT", "stop_words", row))))
            bads.append(word_list(self._word_ids(self._words(arrays, "BAD_WORDS_DICT", "bad_words", row))))
            biases.append(self._embedding_bias(arrays, row))

        width = max(lengths)
        input_ids = np.full((len(prompts), width), pad_ids[0], dtype=np.int32)
        for row, ids in enumerate(prompts):
            input_ids[row, : len(ids)] = ids
        return {
            "INPUT_ID": input_ids,
            "REQUEST_INPUT_LEN": _column(lengths),
            "REQUEST_OUTPUT_LEN": _column(output_lens),
            "OUT_END_ID": _column(end_ids),
            "OUT_PAD_ID": _column(pad_ids),
            # An encoder-decoder model's decoder prompt; for a decoder-only one, NVIDIA's preprocessing answers a
            # placeholder of one pad token, which its end_to_end_test.py passes on to tensorrt_llm.
            "DECODER_INPUT_ID": _column(pad_ids),
            "REQUEST_DECODER_INPUT_LEN": _column([1] * len(prompts)),
            "STOP_WORDS_IDS": _stack_word_lists(stops),
            "BAD_WORDS_IDS": _stack_word_lists(bads),
            "EMBEDDING_BIAS": _stack_biases(biases, limits.vocab_size),
        }


def _column(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int32).reshape(-1, 1)


def _row_values(array: np.ndarray | None, row: int) -> list:
    """Row `row` of an optional [batch, n] input as a list (a single row applies to all); [] when absent."""
    if array is None or array.size == 0:
        return []
    rows = array.reshape(array.shape[0], -1)
    return rows[row % rows.shape[0]].tolist()


def _stack_biases(biases: list[np.ndarray | None], vocab_size: int) -> np.ndarray:
    """[batch, vocab], or [batch, 0] when no row has a bias (NVIDIA's preprocessing sends the same empty tensor)."""
    if all(b is None for b in biases):
        return np.zeros((len(biases), 0), dtype=np.float32)
    return np.stack([np.zeros(vocab_size, dtype=np.float32) if b is None else b for b in biases])


def _stack_word_lists(lists: list[np.ndarray]) -> np.ndarray:
    width = max(a.shape[1] for a in lists)
    out = np.zeros((len(lists), 2, width), dtype=np.int32)
    out[:, 1, :] = -1
    for row, array in enumerate(lists):
        out[row, :, : array.shape[1]] = array
    return out
