"""bench-peers' report: ratios as medians of per-round ratios, with their range and a verdict that a noisy round
can only make "within noise"."""

from types import SimpleNamespace

from benchmarks.peers import Row, markdown, per_round, verdict


def rows(server: str, per_round_tokens: list[float], load: str = "greedy", concurrency: int = 1) -> list[Row]:
    return [
        Row(server, "OpenAI /v1/completions", "F32", load, concurrency, n + 1, tokens_per_s=tokens, ttft_p50_ms=10.0)
        for n, tokens in enumerate(per_round_tokens)
    ]


def test_a_ratio_is_taken_round_by_round():
    ours, theirs = rows("ours", [110, 90, 120]), rows("llama.cpp", [100, 100, 100])
    assert per_round(ours, theirs, 1, "tokens_per_s", lambda a, b: a / b) == [1.1, 0.9, 1.2]
    assert per_round(ours, theirs[:2], 1, "tokens_per_s", lambda a, b: a / b) == [1.1, 0.9], "both measured only"


def test_the_verdict_needs_every_round():
    assert verdict([1.05, 1.02, 1.10], 1.0) == "ahead"
    assert verdict([0.95, 0.97], 1.0) == "behind"
    assert verdict([1.2, 0.99, 1.3], 1.0) == "within noise"
    assert verdict([-3.0, -1.0], 0.0, higher_is_better=False) == "ahead"  # first token: lower is better
    assert verdict([], 1.0) == "—"


def test_the_report_prints_median_range_and_verdict_per_load():
    ours = rows("ours", [105, 95, 110, 120, 108]) + rows("ours", [90, 91, 92, 93, 94], load="sampled")
    theirs = rows("llama.cpp", [100] * 5) + rows("llama.cpp", [100] * 5, load="sampled")
    args = SimpleNamespace(max_tokens=16, rounds=5, concurrency=1, loads=["greedy", "sampled"])
    report = markdown(ours + theirs, {}, {}, args)
    head = "| ours, OpenAI /v1/completions | llama.cpp | F32 |"
    assert f"{head} greedy | tokens/s c=1 | 1.08 | 0.95 to 1.20 | within noise |" in report
    assert f"{head} sampled | tokens/s c=1 | 0.92 | 0.90 to 0.94 | behind |" in report
    assert f"{head} greedy | first token p50, ms | +0.0 | +0.0 to +0.0 | within noise |" in report
    assert "- ours, OpenAI /v1/completions, F32: c=1 0.86x" in report  # sampled over greedy, ours


def test_memory_is_compared_round_by_round_against_the_target():
    """Ours' largest figure of each round over llama-server's: at or under 1.5 in every round is ahead of it."""
    ours = [
        Row("ours", "OpenAI /v1/completions", "F32", "greedy", c, n, peak_rss_mib=rss, peak_pss_mib=pss)
        for n, c, rss, pss in [(1, 1, 1400, 1200), (1, 16, 1500, 1300), (2, 1, 1450, 1250), (2, 16, 1480, 1260)]
    ]
    theirs = [Row("llama.cpp", "OpenAI /v1/completions", "F32", "greedy", 1, n, peak_rss_mib=1000.0) for n in (1, 2)]
    for row in theirs:
        row.peak_pss_mib = 1000.0
    args = SimpleNamespace(max_tokens=16, rounds=2, concurrency=16, loads=["greedy"])
    report = markdown(ours + theirs, {}, {}, args)
    assert "| ours | llama.cpp | F32 | all | peak RSS / theirs, <= 1.5 | 1.49 | 1.48 to 1.50 | within noise |" in report
    assert "| ours | llama.cpp | F32 | all | peak PSS / theirs, <= 1.5 | 1.28 | 1.26 to 1.30 | ahead |" in report
