"""The memory soak's pure logic: reading VmRSS and naming processes from /proc, the request mix, the verdict."""

from itertools import islice

from benchmarks.memory_soak import BLOCK, engine_counts, memory_table, process_name, request_kinds, verdict, vm_rss_kib

STATUS = """Name:\tpython_backend_
Umask:\t0022
State:\tS (sleeping)
VmPeak:\t 2345678 kB
VmSize:\t 2345600 kB
VmHWM:\t  401234 kB
VmRSS:\t  398765 kB
RssAnon:\t  300000 kB
Threads:\t12
"""


def test_rss_is_the_vmrss_line_not_another_memory_line():
    assert vm_rss_kib(STATUS) == 398765
    zombie = "Name:\ttritonserver\nState:\tZ (zombie)\nThreads:\t1\n"
    assert vm_rss_kib(zombie) is None


def test_processes_are_named_by_the_model_each_stub_serves():
    stub = b"/b/python/triton_python_backend_stub\0/r/model_repository/tensorrt_llm_bls/1/model.py\0prefix\x001\0"
    assert process_name(stub) == "stub tensorrt_llm_bls"
    assert process_name(b"/usr/bin/python3\0-m\0tritonllm.engine.process\0--fd\x003\0") == "engine process"
    assert process_name(b"/v/bin/python\0-m\0tritonllm.openai.app\0--port\x009000\0") == "openai layer"
    assert process_name(b"/w/tritonserver/bin/tritonserver\0--model-repository=/r\0") == "tritonserver"
    assert process_name(b"") == "?"


def test_every_block_of_the_mix_holds_every_kind_in_its_share():
    size = sum(BLOCK.values())
    kinds = list(islice(request_kinds(7), 3 * size))
    for start in (0, size, 2 * size):
        block = kinds[start : start + size]
        assert {kind: block.count(kind) for kind in BLOCK} == BLOCK
    assert kinds == list(islice(request_kinds(7), 3 * size))  # the seed decides the order
    assert kinds != list(islice(request_kinds(8), 3 * size))
    assert kinds[:size] != kinds[size : 2 * size]  # each block is shuffled anew


def test_a_mix_of_some_kinds_sends_only_those():
    kinds = list(islice(request_kinds(7, ["stream", "cancel"]), 80))
    assert set(kinds) == {"stream", "cancel"}
    assert kinds.count("stream") == 5 * kinds.count("cancel") / 3  # BLOCK's shares: 5 streams to 3 cancelled


MIB = 1024


def points(end_engine_kib: int, end_bls: int | None = 200 * MIB) -> list[tuple[str, dict[str, int]]]:
    start = {"tritonserver [1]": 500 * MIB, "stub tensorrt_llm_decoupled [2]": 900 * MIB, "stub bls [3]": 190 * MIB}
    middle = {label: kib + 5 * MIB for label, kib in start.items()}
    end = {"tritonserver [1]": 510 * MIB, "stub tensorrt_llm_decoupled [2]": end_engine_kib}
    if end_bls is not None:
        end["stub bls [3]"] = end_bls
    return [("start", start), ("50 %", middle), ("end", end)]


def test_the_verdict_passes_growth_within_the_bound():
    passed, reasons = verdict(points(end_engine_kib=964 * MIB), 64, [], [])
    assert passed, reasons
    assert reasons == []


def test_the_verdict_fails_on_the_process_that_grew_past_the_bound():
    passed, reasons = verdict(points(end_engine_kib=965 * MIB), 64, [], [])
    assert not passed
    assert reasons == ["stub tensorrt_llm_decoupled [2]: grew 65.0 MiB, more than 64"]


def test_the_verdict_fails_when_a_process_is_gone():
    passed, reasons = verdict(points(end_engine_kib=900 * MIB, end_bls=None), 64, [], [])
    assert not passed
    assert reasons == ["stub bls [3]: gone by the end"]


def test_the_verdict_fails_on_a_failed_request_or_check_whatever_the_memory():
    flat = points(end_engine_kib=900 * MIB)
    passed, reasons = verdict(flat, 64, ["stream: boom", "whole: HTTP 500"], [])
    assert (passed, reasons) == (False, ["2 valid requests failed"])
    passed, reasons = verdict(flat, 64, [], ["the engine still reports 2 requests in flight"])
    assert (passed, reasons) == (False, ["the engine still reports 2 requests in flight"])


def test_the_table_gives_each_point_and_the_growth_in_mib():
    table = memory_table(points(end_engine_kib=964 * MIB, end_bls=None)).splitlines()
    assert table[0] == "| process | start | 50 % | end | growth |"
    assert "| stub tensorrt_llm_decoupled [2] | 900.0 | 905.0 | 964.0 | +64.0 |" in table
    assert "| stub bls [3] | 190.0 | 195.0 | gone | gone |" in table


METRICS = """# TYPE tritonllm_requests_finished_total counter
tritonllm_requests_finished_total{model="tensorrt_llm_decoupled",version="1",device="cpu",finish_reason="length"} 7
tritonllm_requests_finished_total{model="tensorrt_llm_decoupled",version="1",device="cpu",finish_reason="cancelled"} 3
tritonllm_requests_finished_total{model="tensorrt_llm",version="1",device="cpu",finish_reason="cancelled"} 1
tritonllm_request_errors_total{model="tensorrt_llm_decoupled",version="1",device="cpu",kind="generation_failed"} 2
nv_inference_request_failure{model="ensemble",version="1"} 9
"""


def test_engine_counts_sum_each_reason_and_error_kind_over_models():
    counts = engine_counts(METRICS)
    assert counts["cancelled"] == 4
    assert counts["length"] == 7
    assert counts["generation_failed"] == 2
    assert counts["eos"] == 0
