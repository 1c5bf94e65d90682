"""What NVIDIA's own Triton client scripts send, and how they read the answers, as functions.

Written from the documented inputs of two scripts of NVIDIA/TensorRT-LLM,
triton_backend/inflight_batcher_llm/client/ (their command-line options, the tensors those options
become, the gRPC calls made and the outputs read), not copied from them:

- `end_to_end_grpc_client.py` at commit 2a9abd9536aa62ad3e4b9314be9286b1b1be523b: text in, text out,
  to `ensemble` or `tensorrt_llm_bls`, always over a gRPC stream (`start_stream`, one
  `async_stream_infer`, `stop_stream`, then the queued responses);
- `inflight_batcher_llm_client.py` at commit 1d263f15a979ef2902c60de3f6238bcc0952bb29 (the inputs are the
  same at 000a01de66f0eab4ab05640711f0253f50f5209c, whose version.py says 1.0.0rc4): token ids to
  `tensorrt_llm`, over a gRPC stream with `-S` (or `-n`), else one unary `async_infer`.

Each option below carries the script's default, so `EndToEnd(prompt)` and `InflightBatcher(tokenizer_dir)`
are the scripts' default command lines. Options the scripts have for features this server does not
serve (LoRA, prompt tables, draft tokens, context/generation logits, lookahead) and stop-after-ms are not
modelled; the scripts themselves, run unchanged against both deployments, are in docs/api.md.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from tritonllm.protocol import PERF_OUTPUTS


class ScriptFailure(RuntimeError):
    """Where the script itself would stop with a traceback or `sys.exit`; says why."""


def grpc_input(name: str, array: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


def _collect(user_data: queue.Queue, result, error) -> None:
    user_data.put(error if error else result)


def _drain(responses: queue.Queue) -> list:
    out = []
    while True:
        try:
            out.append(responses.get(block=False))
        except queue.Empty:
            return out


# ------------------------------------------------------------------ end_to_end_grpc_client.py


@dataclass
class EndToEnd:
    """The script's options (flag in the comment) with its defaults."""

    prompt: str  # -p
    output_len: int = 100  # -o
    model_name: str = "ensemble"  # --model-name: "ensemble" or "tensorrt_llm_bls"
    streaming: bool = False  # -S
    beam_width: int = 1  # -b
    temperature: float = 1.0  # --temperature
    repetition_penalty: float | None = None  # --repetition-penalty
    presence_penalty: float | None = None  # --presence-penalty
    frequency_penalty: float | None = None  # --frequency-penalty
    stop_words: list[str] = field(default_factory=list)  # --stop-words
    bad_words: list[str] = field(default_factory=list)  # --bad-words
    embedding_bias_words: list[str] = field(default_factory=list)  # --embedding-bias-words
    embedding_bias_weights: list[str] = field(default_factory=list)  # --embedding-bias-weights (text, as argparse)
    return_log_probs: bool = False  # --return-log-probs
    end_id: int | None = None  # --end-id
    pad_id: int | None = None  # --pad-id
    exclude_input_in_output: bool = False  # --exclude-input-in-output
    guided_decoding_guide_type: str | None = None  # --guided-decoding-guide-type
    guided_decoding_guide: str | None = None  # --guided-decoding-guide
    num_return_sequences: int | None = None  # -n
    overwrite_output_text: bool = False  # --overwrite-output-text
    request_id: str = ""  # --request-id
    return_perf_metrics: bool = False  # --return-perf-metrics
    batch_inputs: list[str] | None = None  # -p with a JSON list and --batch-inputs: these prompts as one batch


def end_to_end_inputs(options: EndToEnd) -> dict[str, np.ndarray]:
    """The tensors the script sends for one prompt: every one [1, 1], except the word lists [1, n]; with
    --batch-inputs, each prompt's tensors stacked along the batch."""
    if options.batch_inputs:
        rows = [end_to_end_inputs(replace(options, prompt=p, batch_inputs=None)) for p in options.batch_inputs]
        return {name: np.concatenate([row[name] for row in rows]) for name in rows[0]}
    inputs = {
        "text_input": np.array([[options.prompt]]).astype(object),
        "max_tokens": np.full((1, 1), options.output_len, dtype=np.int32),
        "stream": np.array([[options.streaming]], dtype=bool),
        "beam_width": np.array([[options.beam_width]], dtype=np.int32),
        "temperature": np.array([[options.temperature]], dtype=np.float32),
    }
    if options.num_return_sequences is not None:
        inputs["num_return_sequences"] = np.array([[options.num_return_sequences]], dtype=np.int32)
    if options.bad_words:
        inputs["bad_words"] = np.array([options.bad_words], dtype=object)
    if options.stop_words:
        inputs["stop_words"] = np.array([options.stop_words], dtype=object)
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        if getattr(options, name) is not None:
            inputs[name] = np.array([[getattr(options, name)]], dtype=np.float32)
    if options.return_log_probs:
        inputs["return_log_probs"] = np.array([[True]], dtype=bool)
    if options.return_perf_metrics:
        inputs["return_perf_metrics"] = np.array([[True]], dtype=bool)
    if bool(options.embedding_bias_words) != bool(options.embedding_bias_weights):
        raise ScriptFailure("Both embedding bias words and weights must be specified")
    if options.embedding_bias_words:
        if len(options.embedding_bias_words) != len(options.embedding_bias_weights):
            raise ScriptFailure("Embedding bias weights and words must have same length")
        inputs["embedding_bias_words"] = np.array([options.embedding_bias_words], dtype=object)
        inputs["embedding_bias_weights"] = np.array([options.embedding_bias_weights], dtype=np.float32)
    if options.end_id is not None:
        inputs["end_id"] = np.array([[options.end_id]], dtype=np.int32)
    if options.pad_id is not None:
        inputs["pad_id"] = np.array([[options.pad_id]], dtype=np.int32)
    # Always sent: the flag's default is False, and the script tests it with `is not None`.
    inputs["exclude_input_in_output"] = np.array([[options.exclude_input_in_output]], dtype=bool)
    if options.guided_decoding_guide_type is not None:
        inputs["guided_decoding_guide_type"] = np.array([[options.guided_decoding_guide_type]]).astype(object)
    if options.guided_decoding_guide is not None:
        inputs["guided_decoding_guide"] = np.array([[options.guided_decoding_guide]]).astype(object)
    return inputs


def end_to_end_outputs(options: EndToEnd) -> list[str]:
    """The outputs the script asks for."""
    names = ["text_output"]
    if options.return_log_probs:
        names += ["cum_log_probs", "output_log_probs"]
    if options.num_return_sequences is not None and options.num_return_sequences > 1:
        names.append("sequence_index")
    if options.batch_inputs:
        names.append("batch_index")
    if options.return_perf_metrics:
        names += list(PERF_OUTPUTS)
    return names


@dataclass
class EndToEndResult:
    texts: list[str]  # one per generation (beam or returned sequence), "" where nothing came; per batch row, in order
    errors: list[InferenceServerException]  # the script prints these ("Received an error from server") and goes on
    responses: list  # the InferResult objects, in arrival order


def _text(output: np.ndarray) -> str:
    """`output[0].decode("utf-8")`: the script's reading of text_output, which needs a 1-D tensor of bytes."""
    first = output[0]
    if not isinstance(first, bytes):
        raise ScriptFailure(
            f"text_output has shape {output.shape}: the script reads output[0].decode('utf-8'), so it needs "
            f"text_output with one dimension (NVIDIA's postprocessing returns [batch * beams]); output[0] is "
            f"{type(first).__name__}, which has no decode() (AttributeError in the script)"
        )
    return first.decode("utf-8")


def run_end_to_end(url: str, options: EndToEnd) -> EndToEndResult:
    """Send one prompt as the script does, and read the responses as it does (`run_inference`)."""
    inputs = [grpc_input(name, array) for name, array in end_to_end_inputs(options).items()]
    outputs = [grpcclient.InferRequestedOutput(name) for name in end_to_end_outputs(options)]
    generations = options.beam_width if options.num_return_sequences is None else options.num_return_sequences
    texts = [""] * generations * len(options.batch_inputs or [options.prompt])
    responses: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=partial(_collect, responses))
        client.async_stream_infer(options.model_name, inputs, outputs=outputs, request_id=options.request_id)
        client.stop_stream()  # waits for the server to finish the stream
    received = _drain(responses)
    errors = [r for r in received if isinstance(r, InferenceServerException)]
    results = [r for r in received if not isinstance(r, InferenceServerException)]
    for result in results:
        seq_index = result.as_numpy("sequence_index")
        seq_index = 0 if seq_index is None else int(seq_index[0][0])
        batch_index = result.as_numpy("batch_index")
        at = (0 if batch_index is None else int(batch_index[0][0])) * generations + seq_index
        text = _text(result.as_numpy("text_output"))
        if options.streaming and options.beam_width == 1 and not options.overwrite_output_text:
            texts[at] += text
        else:
            texts[at] = text
    return EndToEndResult(texts, errors, results)


# ------------------------------------------------------------------ inflight_batcher_llm_client.py


@dataclass
class InflightBatcher:
    """The script's options (flag in the comment) with its defaults."""

    tokenizer_dir: str  # --tokenizer-dir (used unless input ids are given)
    text: str = "Born in north-east France, Soyer trained as a"  # --text
    input_ids: list[int] | None = None  # --input-tokens-csv: these ids instead of the tokenized text
    end_id: int = -1  # --end-id (only with --input-tokens-csv; else the tokenizer's)
    pad_id: int = 50256  # --pad-id (only with --input-tokens-csv; else the tokenizer's)
    request_output_len: int = 16  # --request-output-len
    streaming: bool = False  # -S
    beam_width: int = 1  # -b
    temperature: float = 1.0  # --temperature
    top_k: int = 1  # --top-k
    top_p: float = 0.0  # --top-p
    repetition_penalty: float | None = None  # --repetition-penalty
    presence_penalty: float | None = None  # --presence-penalty
    frequency_penalty: float | None = None  # --frequency-penalty
    return_log_probs: bool = False  # --return-log-probs
    exclude_input_in_output: bool = False  # --exclude-input-in-output
    return_num_input_tokens: bool = False  # --return-num-input-tokens
    return_num_output_tokens: bool = False  # --return-num-output-tokens
    return_perf_metrics: bool = False  # --return-perf-metrics
    num_return_sequences: int | None = None  # -n
    requested_outputs: list[str] = field(default_factory=list)  # --requested-outputs (empty: all)
    model_name: str = "tensorrt_llm"  # --model-name
    request_id: str = ""  # --request-id
    stream_timeout: float | None = None  # -t


def prompt_ids(options: InflightBatcher, tokenizer) -> tuple[list[int], int, int]:
    """(input ids, end id, pad id) as the script takes them: from the tokenizer unless ids are given."""
    if options.input_ids is not None:
        return list(options.input_ids), options.end_id, options.pad_id
    pad_token = tokenizer.pad_token or tokenizer.eos_token  # the script sets pad_token = eos_token when unset
    pad_id = tokenizer.encode(pad_token, add_special_tokens=False)[0]
    end_id = tokenizer.encode(tokenizer.eos_token, add_special_tokens=False)[0]
    return tokenizer.encode(options.text), end_id, pad_id


def inflight_batcher_inputs(options: InflightBatcher, ids: list[int], end_id: int, pad_id: int) -> dict:
    """The tensors the script sends to tensorrt_llm, in its order: the ten it always sends, then the options."""
    inputs = {
        "input_ids": np.array([ids], dtype=np.int32),
        "input_lengths": np.array([[len(ids)]], dtype=np.int32),
        "request_output_len": np.array([[options.request_output_len]], dtype=np.int32),
        "beam_width": np.array([[options.beam_width]], dtype=np.int32),
        "temperature": np.array([[options.temperature]], dtype=np.float32),
        "streaming": np.array([[options.streaming]], dtype=bool),
        "end_id": np.array([[end_id]], dtype=np.int32),
        "pad_id": np.array([[pad_id]], dtype=np.int32),
        "runtime_top_k": np.array([[options.top_k]], dtype=np.int32),
        "runtime_top_p": np.array([[options.top_p]], dtype=np.float32),
    }
    for name in ("return_num_input_tokens", "return_num_output_tokens", "return_perf_metrics"):
        if getattr(options, name):
            inputs[name] = np.array([[True]], dtype=bool)
    if options.num_return_sequences:
        inputs["num_return_sequences"] = np.array([[options.num_return_sequences]], dtype=np.int32)
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        if getattr(options, name) is not None:
            inputs[name] = np.array([[getattr(options, name)]], dtype=np.float32)
    if options.return_log_probs:
        inputs["return_log_probs"] = np.array([[True]], dtype=bool)
    if options.exclude_input_in_output:  # sent only with the flag
        inputs["exclude_input_in_output"] = np.array([[True]], dtype=bool)
    return inputs


@dataclass
class InflightBatcherResult:
    input_ids: list[int]
    output_ids: list[list[int]]  # per generation, with the prompt unless --exclude-input-in-output
    texts: list[str]  # per generation: the tokenizer's decoding of the tokens after the prompt
    sequence_lengths: list
    cum_log_probs: list
    output_log_probs: list
    num_input_tokens: list
    num_output_tokens: list
    perf_metrics: dict = field(default_factory=dict)  # name -> the last response's value, as the script prints them
    responses: list = field(default_factory=list)


def run_inflight_batcher(url: str, options: InflightBatcher, tokenizer) -> InflightBatcherResult:
    """Send the request as the script does and read the answers as it does; an error response raises, as there."""
    ids, end_id, pad_id = prompt_ids(options, tokenizer)
    inputs = [grpc_input(name, array) for name, array in inflight_batcher_inputs(options, ids, end_id, pad_id).items()]
    if options.requested_outputs and "output_ids" not in options.requested_outputs:
        raise ScriptFailure('requested outputs must at least have "output_ids"')
    outputs = [grpcclient.InferRequestedOutput(n) for n in options.requested_outputs] or None
    if options.num_return_sequences is not None and options.beam_width != 1:
        raise ScriptFailure("num_return_sequences needs beam width 1 (the script asserts it)")
    generations = options.beam_width if options.num_return_sequences is None else options.num_return_sequences
    on_stream = options.streaming or options.num_return_sequences is not None
    start = [] if options.exclude_input_in_output else list(ids)
    out = InflightBatcherResult(
        input_ids=list(ids),
        output_ids=[list(start) if options.streaming else [] for _ in range(generations)],
        texts=[],
        sequence_lengths=[None] * generations,
        cum_log_probs=[None] * generations,
        output_log_probs=[None] * generations,
        num_input_tokens=[None] * generations,
        num_output_tokens=[None] * generations,
    )

    def set_output(target: list, data, seq_idx: int) -> None:
        if options.beam_width > 1:
            for beam in range(options.beam_width):
                target[beam] = data[beam]
        else:
            target[seq_idx] = data

    responses: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(url) as client:
        if on_stream:
            client.start_stream(callback=partial(_collect, responses), stream_timeout=options.stream_timeout)
            client.async_stream_infer(options.model_name, inputs, outputs=outputs, request_id=options.request_id)
            client.stop_stream(cancel_requests=False)
            received = _drain(responses)
        else:
            client.async_infer(
                options.model_name,
                inputs,
                outputs=outputs,
                request_id=options.request_id,
                callback=partial(_collect, responses),
                parameters={"Streaming": options.streaming},
            )
            received = [responses.get(timeout=options.stream_timeout)]
    for result in received:
        if isinstance(result, InferenceServerException):
            if result.status() == "StatusCode.CANCELLED":
                continue  # the script prints "Request is cancelled"
            raise result  # the script prints it, re-raises, and exits with "Encountered error: ..."
        if options.requested_outputs:
            names = {o.name for o in result.get_response().outputs}
            if names != set(options.requested_outputs):
                raise ScriptFailure(
                    f"expected outputs do not match actual outputs {options.requested_outputs} != {names}"
                )
        output_ids = result.as_numpy("output_ids")
        if output_ids is None:
            continue  # the script prints "Got cancellation response from server"
        out.responses.append(result)
        seq_idx = result.as_numpy("sequence_index")
        seq_idx = 0 if seq_idx is None else int(seq_idx[0][0])
        if options.return_log_probs:
            set_output(out.cum_log_probs, result.as_numpy("cum_log_probs")[0], seq_idx)
            set_output(out.output_log_probs, result.as_numpy("output_log_probs")[0], seq_idx)
        if options.return_num_input_tokens:
            out.num_input_tokens[seq_idx] = result.as_numpy("num_input_tokens")
        if options.return_num_output_tokens:
            out.num_output_tokens[seq_idx] = result.as_numpy("num_output_tokens")
        if options.return_perf_metrics:
            out.perf_metrics = {name: result.as_numpy(name)[0][0] for name in PERF_OUTPUTS}
        if on_stream:
            out.sequence_lengths[seq_idx] = result.as_numpy("sequence_length")[0][0]
            if options.streaming:
                if out.sequence_lengths[seq_idx] is None or out.sequence_lengths[seq_idx] > 0:
                    out.output_ids[seq_idx] += list(output_ids[0][0])
            else:
                out.output_ids[seq_idx].extend(list(output_ids[0][0]))
        elif options.beam_width > 1:
            set_output(out.sequence_lengths, result.as_numpy("sequence_length")[0], seq_idx)
            for beam in range(options.beam_width):
                out.output_ids[beam].extend(list(output_ids[0][beam]))
        else:
            out.sequence_lengths[seq_idx] = result.as_numpy("sequence_length")[0][0]
            out.output_ids[seq_idx].extend(list(output_ids[0][0]))
    for seq_idx in range(generations):
        length = out.sequence_lengths[seq_idx] if not options.streaming else len(out.output_ids[seq_idx])
        with_prompt = out.output_ids[seq_idx][:length]
        without_prompt = with_prompt if options.exclude_input_in_output else with_prompt[len(ids) :]
        out.texts.append(tokenizer.decode(without_prompt))
    return out
