"""Guided decoding in the portable engine (xgrammar): JSON, JSON schema, regular expression and EBNF guides give
output in their language and end on the end id; a guide that does not compile fails its request alone, and a
repeated guide is compiled once."""

import contextlib
import json
import re
import threading
import time
from types import SimpleNamespace

import jsonschema
import pytest
import torch
import xgrammar

from tests.polling import eventually
from tests.unit.engine.conftest import chat_ids, submitted
from tests.unit.engine.test_cpu_engines import make_engine
from tritonllm.engine import guided as guided_module
from tritonllm.engine.api import LLAMACPP, GenerationRequest, Guide, Penalties, SamplingParams
from tritonllm.engine.grammar_check import GUIDE_COMPILERS
from tritonllm.engine.guided import GuidedDecoding, Guides
from tritonllm.errors import ErrorKind, InputError
from tritonllm.protocol import FINISH_EOS, FINISH_ERROR


def guided(engine, tokenizer, prompt: str, guide: Guide, n: int = 48, **kwargs) -> tuple[str, str]:
    request = GenerationRequest(chat_ids(tokenizer, prompt), n, end_id=tokenizer.eos_token_id, guide=guide, **kwargs)
    tokens, reason = engine.generate(request, timeout=180)
    return tokenizer.decode(tokens), reason


SCHEMAS = [
    (
        "Describe a person as JSON with name and age.",
        {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    ),
    (
        "Is the sky blue? Answer in JSON.",
        {
            "type": "object",
            "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "number"}},
            "required": ["answer", "confidence"],
            "additionalProperties": False,
        },
    ),
    (
        "Give me a few prime numbers as a JSON array.",
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    ),
    (
        "What is the capital of France? Answer in JSON.",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "capital": {"type": "boolean"},
            },
            "required": ["city", "capital"],
            "additionalProperties": False,
        },
    ),
]


@pytest.mark.parametrize(("prompt", "schema"), SCHEMAS)
def test_json_schema_output_validates(engine, tokenizer, prompt, schema):
    text, reason = guided(engine, tokenizer, prompt, Guide("json_schema", json.dumps(schema)))
    assert reason == FINISH_EOS  # the grammar complete, only the end id was left
    jsonschema.validate(json.loads(text), schema)


def test_json_guide_gives_json(engine, tokenizer):
    text, reason = guided(engine, tokenizer, "Describe a person as JSON with name and age.", Guide("json"))
    assert reason == FINISH_EOS
    json.loads(text)


@pytest.mark.parametrize(
    "pattern", [r"(yes|no)", r"[0-9]{3}-[0-9]{4}", r"\d{4}-\d{2}-\d{2}", r"(Paris|London|Rome), [A-Z][a-z]{2,12}\."]
)
def test_regex_output_matches(engine, tokenizer, pattern):
    text, reason = guided(engine, tokenizer, "What is the capital of France?", Guide("regex", pattern), n=24)
    assert reason == FINISH_EOS
    assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize(
    ("grammar", "language"),
    [
        ('root ::= "The answer is " ("yes" | "no") "."', r"The answer is (yes|no)\."),
        (
            'root ::= city ", " country\ncity ::= [A-Z] [a-z]{1,10}\ncountry ::= "France" | "Italy" | "Spain"',
            r"[A-Z][a-z]{1,10}, (France|Italy|Spain)",
        ),
    ],
)
def test_ebnf_output_is_in_the_language(engine, tokenizer, grammar, language):
    text, reason = guided(engine, tokenizer, "Where is Paris?", Guide("ebnf_grammar", grammar), n=24)
    assert reason == FINISH_EOS
    assert re.fullmatch(language, text), text


def test_sampled_output_keeps_to_the_guide(engine, tokenizer):
    pattern = r"[a-z]{2,8}( [a-z]{2,8}){2}\."
    for seed in range(3):
        sampling = SamplingParams(sample=True, temperature=1.5, top_k=0, top_p=1.0, seed=seed)
        text, reason = guided(engine, tokenizer, "Say three words.", Guide("regex", pattern), n=32, sampling=sampling)
        assert reason == FINISH_EOS and re.fullmatch(pattern, text), text


def test_streaming_and_concurrent_guided_requests_each_keep_their_guide(engine, tokenizer):
    guides = [
        Guide("regex", r"(yes|no)"),
        Guide("json_schema", json.dumps(SCHEMAS[2][1])),
        Guide("ebnf_grammar", 'root ::= "The answer is " ("yes" | "no") "."'),
        Guide("json"),
    ]
    prompt = chat_ids(tokenizer, "Is Paris in France?")
    requests = [GenerationRequest(prompt, 32, end_id=tokenizer.eos_token_id, guide=g) for g in guides]
    alone = [engine.generate(r, timeout=180) for r in requests]
    results: list = [None] * len(requests)
    finished = threading.Semaphore(0)
    for i, request in enumerate(requests):
        streamed: list = []

        def emit(e, i=i, streamed=streamed):
            streamed.append(e)
            if e.final:
                results[i] = ([t for x in streamed for t in x.token_ids], e.finish_reason)
                finished.release()

        engine.submit(
            GenerationRequest(request.input_ids, 32, end_id=request.end_id, guide=request.guide, streaming=bool(i % 2)),
            emit,
        )
    for _ in requests:
        assert finished.acquire(timeout=300)
    assert results == alone
    assert len(engine.guides) == 0  # every matcher released


@pytest.mark.parametrize(
    "guide",
    [
        Guide("regex", "[a-"),
        Guide("ebnf_grammar", 'root ::= "a" | '),
        Guide("ebnf_grammar", 'start ::= "a"'),  # no root rule
        Guide("json_schema", "not json"),
        Guide("json_schema", json.dumps({"type": "nope"})),
    ],
)
def test_a_guide_that_does_not_compile_fails_its_request_alone(engine, tokenizer, guide):
    with pytest.raises(InputError) as refused:
        engine.submit(GenerationRequest([1, 2, 3], 8, guide=guide), lambda e: None)
    assert refused.value.field == "guided_decoding_guide"
    assert f"the {guide.type} guide does not compile" in str(refused.value)
    assert "/project/" not in str(refused.value)  # xgrammar's source location is left out
    assert engine.running() == 0 and len(engine.guides) == 0
    assert engine.generate(GenerationRequest(chat_ids(tokenizer, "Hi"), 3, end_id=-1), timeout=60)[1]


def test_a_repeated_guide_is_compiled_once(engine, tokenizer):
    guide = Guide("regex", r"(red|green|blue|yellow)")
    before = engine.guides.compilations
    outputs = [guided(engine, tokenizer, "Name a color.", guide, n=8) for _ in range(2)]
    threads = [threading.Thread(target=guided, args=(engine, tokenizer, "Name a color.", guide, 8)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert engine.guides.compilations == before + 1
    assert outputs[0] == outputs[1]
    bad = Guide("regex", "(unclosed")
    for _ in range(2):
        with pytest.raises(InputError):
            engine.submit(GenerationRequest([1], 4, guide=bad), lambda e: None)
    assert engine.guides.compilations == before + 2


@pytest.fixture
def slow(monkeypatch):
    """Guides whose compile of a regex guide sleeps as many seconds as its text says, under a deadline of 0.3 s; and
    what it compiled, and how many compiles ran at once at most."""
    state, lock = SimpleNamespace(compiled=[], running=0, most=0), threading.Lock()

    def compile_slowly(self, kind: str, text: str) -> str:
        with lock:
            state.compiled.append(text)
            state.running += 1
            state.most = max(state.most, state.running)
        time.sleep(float(text))
        with lock:
            state.running -= 1
        return f"grammar {text}"

    monkeypatch.setattr(Guides, "_compile", compile_slowly)
    monkeypatch.setattr(guided_module, "GUIDE_COMPILE_SECONDS", 0.3)
    return Guides("unused", 100), state


def test_a_guide_compiling_past_the_deadline_fails_its_requests_and_is_not_kept(slow):
    guides, state = slow
    started = time.monotonic()
    with pytest.raises(InputError) as late:
        guides.compile(Guide("regex", "0.8"))
    assert time.monotonic() - started < 0.6  # it waited the deadline, not the compile
    assert late.value.field == "guided_decoding_guide"
    assert str(late.value).endswith("the regex guide did not compile within the limit of 0.3 s")
    started = time.monotonic()
    with pytest.raises(InputError, match=r"within the limit of 0\.3 s"):  # at once, while it still compiles
        guides.compile(Guide("regex", "0.8"))
    assert time.monotonic() - started < 0.1 and state.compiled == ["0.8"]
    assert eventually(lambda: state.running == 0, 5)
    # Its result came late: not kept as a success, it is compiled anew (and fails again).
    with pytest.raises(InputError, match=r"within the limit of 0\.3 s"):
        guides.compile(Guide("regex", "0.8"))
    assert state.compiled == ["0.8", "0.8"]
    assert guides.compile(Guide("regex", "0.01")) == "grammar 0.01"


def test_at_most_a_few_guides_compile_at_once_and_a_compiled_one_is_served_meanwhile(slow):
    guides, state = slow
    assert guides.compile(Guide("regex", "0")) == "grammar 0"
    texts = [f"0.5{i}" for i in range(6)]

    def request(text: str) -> None:
        with contextlib.suppress(InputError):
            guides.compile(Guide("regex", text))

    threads = []
    for text in texts:  # in this order: the last waits for a compiler past its deadline
        threads.append(threading.Thread(target=request, args=(text,)))
        threads[-1].start()
        time.sleep(0.02)
    started = time.monotonic()
    assert guides.compile(Guide("regex", "0")) == "grammar 0" and time.monotonic() - started < 0.1
    for thread in threads:
        thread.join(10)
    assert eventually(lambda: sorted(state.compiled) == ["0", *texts] and state.running == 0, 10)
    assert state.most == GUIDE_COMPILERS
    # The last one's request gave up while it waited for a compiler: it compiled for the requests after.
    assert guides.compile(Guide("regex", texts[-1])) == f"grammar {texts[-1]}"
    assert len(state.compiled) == 1 + len(texts)


@pytest.fixture(scope="module")
def llama(manifest):
    eng = make_engine(manifest, LLAMACPP, max_batch_size=4, max_seq_len=512, kv_cache_tokens=2048)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("engine_name", ["engine", "llama"], ids=["transformers", "llamacpp"])
def test_min_tokens_past_the_grammars_end_fails_the_request_alone(request, tokenizer, engine_name, streaming):
    """The grammar allows only the end id, which min_tokens bans: nothing is left, and the request used to go on
    unguided to a success with text off its guide. It fails with why; the request beside it keeps to its guide."""
    engine = request.getfixturevalue(engine_name)
    ids, guide, end = chat_ids(tokenizer, "Is Paris in France?"), Guide("regex", "(yes|no)"), tokenizer.eos_token_id
    bad = GenerationRequest(ids, 24, end_id=end, guide=guide, streaming=streaming, penalties=Penalties(min_tokens=6))
    good = GenerationRequest(ids, 24, end_id=end, guide=guide, streaming=streaming)
    (bad_done, bad_emissions), (good_done, good_emissions) = submitted(engine, bad), submitted(engine, good)
    assert bad_done.wait(180) and good_done.wait(180)
    failed = bad_emissions[-1]
    assert failed.finish_reason == FINISH_ERROR and "min_tokens: is 6" in failed.error, failed
    assert failed.error_kind is ErrorKind.INVALID_INPUT, "the client's mistake, found late: a 400, not a 500"
    if engine_name == "llama" or not streaming:  # a stream of the transformers engine may have sent the token before
        assert tokenizer.decode([t for e in bad_emissions for t in e.token_ids]) in ("", "y", "ye", "yes", "n", "no")
    assert good_emissions[-1].finish_reason == FINISH_EOS
    assert tokenizer.decode([t for e in good_emissions for t in e.token_ids]) in ("yes", "no")
    assert engine.running() == 0


@pytest.mark.parametrize("engine_name", ["engine", "llama"], ids=["transformers", "llamacpp"])
def test_a_last_token_off_the_grammar_fails_the_request_too(request, tokenizer, engine_name):
    """The refused token is the request's last: no later step's matcher meets it, and the request ended a success."""
    engine = request.getfixturevalue(engine_name)
    ids, guide = chat_ids(tokenizer, "Is Paris in France?"), Guide("regex", "(yes|no)")
    (yes,) = tokenizer.encode("yes", add_special_tokens=False)
    bad = GenerationRequest(
        ids,
        2,
        end_id=tokenizer.eos_token_id,
        guide=guide,
        penalties=Penalties(min_tokens=2),
        embedding_bias=((yes, 50.0),),
    )
    done, emissions = submitted(engine, bad)
    assert done.wait(180)
    assert emissions[-1].finish_reason == FINISH_ERROR and "ends after 1 tokens" in emissions[-1].error


def test_the_mask_unpacks_xgrammars_bits():
    """The step's tensor unpacking agrees with xgrammar's own kernel, for guided rows only."""
    vocab = 100
    group = GuidedDecoding(SimpleNamespace(vocab_size=vocab), max_rows=3, device="cpu")
    group.mask.copy_(torch.randint(-(2**31), 2**31 - 1, group.mask.shape, dtype=torch.int32))
    scores = torch.randn(3, vocab)
    out = group.apply(scores.clone(), torch.tensor([[1, 0, 1]], dtype=torch.int32), torch.zeros(3))
    expected = scores.clone()
    xgrammar.apply_token_bitmask_inplace(expected, group.mask, indices=[0, 2])
    assert torch.equal(out, expected)


class FailingMatcher:
    """A grammar matcher whose `method` raises from its call number `after` + 1 on; the rest is the matcher's."""

    def __init__(self, matcher, method: str, after: int) -> None:
        self.matcher, self.method, self.after, self.calls = matcher, method, after, 0

    def __getattr__(self, name: str):
        attribute = getattr(self.matcher, name)
        if name != self.method:
            return attribute

        def failing(*args):
            self.calls += 1
            if self.calls > self.after:
                raise RuntimeError("injected matcher fault")
            return attribute(*args)

        return failing


@pytest.mark.parametrize("method", ["accept_token", "fill_next_token_bitmask"])
@pytest.mark.parametrize("engine_name", ["engine", "llama"], ids=["transformers", "llamacpp"])
def test_a_grammar_matcher_fault_fails_its_request_alone(request, monkeypatch, tokenizer, engine_name, method):
    """xgrammar's matcher runs inside the step every request shares: its fault is the guided request's alone, the
    request beside it keeps to its guide and the engine serves on."""
    engine = request.getfixturevalue(engine_name)
    guides = engine.guides if engine_name == "engine" else engine._guides_ready()
    faulty, sound = Guide("regex", "(yes|no|maybe)( indeed)?"), Guide("regex", "(yes|no)")
    faulty_grammar = guides.compile(faulty)
    start = Guides.start

    def start_faulty(self, request_id, compiled, *args) -> None:
        start(self, request_id, compiled, *args)
        if compiled is faulty_grammar:
            follower = self.follower(request_id)
            follower.matcher = FailingMatcher(follower.matcher, method, after=1)

    monkeypatch.setattr(Guides, "start", start_faulty)
    ids, end = chat_ids(tokenizer, "Is Paris in France?"), tokenizer.eos_token_id
    bad = GenerationRequest(ids, 24, end_id=end, guide=faulty)
    good = GenerationRequest(ids, 24, end_id=end, guide=sound, streaming=True)
    (bad_done, bad_emissions), (good_done, good_emissions) = submitted(engine, bad), submitted(engine, good)
    assert bad_done.wait(180) and good_done.wait(180)
    failed = bad_emissions[-1]
    assert failed.finish_reason == FINISH_ERROR and "grammar matcher failed" in failed.error, failed
    assert "injected matcher fault" in failed.error
    assert failed.error_kind in (None, ErrorKind.INTERNAL)
    assert good_emissions[-1].finish_reason == FINISH_EOS
    assert tokenizer.decode([t for e in good_emissions for t in e.token_ids]) in ("yes", "no")
    assert engine.alive() and eventually(lambda: engine.running() == 0, 10)
    monkeypatch.undo()
    text, reason = guided(engine, tokenizer, "Is Paris in France?", faulty, n=8)
    assert reason == FINISH_EOS and re.fullmatch(faulty.text, text)
