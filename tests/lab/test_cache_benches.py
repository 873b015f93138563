"""`servelab bench prefix` and `bench chunked`: the prefix bench's job file, counter reading and table; the chunked
bench's round on the tiny engine (which gaps it counts, never how long they are); both commands refuse bad
options by name before starting anything. (What they measure needs the bundled model, a stack and minutes:
they are run by hand, see docs/performance.md.)"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from servelab.analysis.workload import system_prompt
from servelab.cli import app
from servelab.lab.chunked_bench import ChunkedBenchError, ChunkedShape, format_chunked_table, run_chunked_bench
from servelab.lab.prefix_bench import (PrefixJob, answers, batch_lines, format_prefix_table, prefix_cache_counts,
                                       round_order)
from servelab.request import GenerationRequest, SamplingParams


def exposition(*samples: tuple[str, str, float]) -> str:
    """A /metrics page of counters: (name, model_name, value) each, with their HELP and TYPE lines."""
    lines = []
    for name in dict.fromkeys(name for name, _, _ in samples):
        lines += [f"# HELP {name} a counter", f"# TYPE {name} counter"]
        lines += [f'{n}_total{{model_name="{model}"}} {value}' for n, model, value in samples if n == name]
    return "\n".join(lines) + "\n"


def test_every_line_of_the_prefix_job_opens_with_the_workloads_system_prompt_and_asks_its_own_question() -> None:
    records = [json.loads(line) for line in batch_lines("on", num_lines=70, max_new_tokens=5).splitlines()]
    assert [r["custom_id"] for r in records] == [f"line-{i}" for i in range(70)]
    assert all(r["url"] == "/v1/chat/completions" and r["body"]["model"] == "on" and r["body"]["max_tokens"] == 5
               and r["body"]["ignore_eos"] for r in records)
    assert {r["body"]["messages"][0]["content"] for r in records} == {system_prompt("library")}
    tails = [r["body"]["messages"][1]["content"] for r in records]
    assert len(set(tails)) == 70, "more lines than questions: the ticket number still tells them apart"


def test_the_answers_are_read_from_the_output_file_by_custom_id() -> None:
    def line(custom_id: str, text: str) -> str:
        return json.dumps({"id": "batch_req_x", "custom_id": custom_id, "error": None, "response": {
            "status_code": 200, "body": {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}}})

    assert answers(f"{line('line-1', 'Yes.')}\n{line('line-0', 'No.')}\n".encode()) == {"line-1": "Yes.", "line-0": "No."}
    assert answers(b"") == {}


def test_the_counters_are_read_summed_over_labels_and_missing_ones_are_none() -> None:
    queries, hits = "servelab:prefix_cache_queries", "servelab:prefix_cache_hits"
    page = exposition((queries, "on", 1200.0), (queries, "other", 300.0), (hits, "on", 900.0),
                      ("servelab:request_success", "on", 7.0))
    assert prefix_cache_counts(page) == (1500.0, 900.0)
    assert prefix_cache_counts(exposition(("servelab:request_success", "on", 7.0))) == (None, None)


def test_the_table_gives_each_job_the_ratio_and_the_answers_agreement_and_says_n_a_without_counters() -> None:
    said = {"line-0": "Yes.", "line-1": "No."}
    jobs = [PrefixJob("off", 1, 40.0, 10, 0, 6000, 40, None, None, said),
            PrefixJob("on", 1, 10.0, 10, 0, 6000, 40, 6000, 5400, {**said, "line-1": "Maybe."}),
            PrefixJob("on", 2, 12.0, 10, 0, 6000, 40, 6000, 5700, said), PrefixJob("off", 2, 36.0, 10, 0, 6000, 40, 0, 0, said)]
    table = format_prefix_table(jobs, ["off", "on"])
    rows = [line.split() for line in table.splitlines()[1:5]]
    assert [(r[0], r[1], r[-1]) for r in rows] == [("1", "off", "n/a"), ("1", "on", "%"), ("2", "off", "n/a"),
                                                   ("2", "on", "%")]
    assert "90.0 %" in table and "95.0 %" in table
    assert "on against off: wall time x0.292 (median of 2 round(s)" in table  # rounds 0.25 and 0.333
    assert "on against off: identical greedy answers on 3 of 4 lines" in table
    assert round_order(["off", "on"], 1) == ["off", "on"] and round_order(["off", "on"], 2) == ["on", "off"]


def test_a_chunked_round_counts_the_rows_gaps_alone_and_while_the_newcomer_is_prefilled(tiny_engine) -> None:
    shape = ChunkedShape(num_rows=3, newcomer_tokens=100, window_steps=4, warmup_steps=2)
    rounds = run_chunked_bench(tiny_engine, shape, num_rounds=2)
    assert tiny_engine.num_live == 0, "the round hands the engine back empty"
    for r in rounds:
        assert len(r.alone_gaps_ms) == 3 * 4, "a gap per row and window step"
        # NOTE: a gap per row and call that gave the rows a token until the newcomer's first (an engine that prefills
        # a prompt whole inside add: one, the rows' next token, which waited on it)
        assert r.num_calls >= 1 and 3 <= len(r.joined_gaps_ms) <= 3 * r.num_calls and len(r.joined_gaps_ms) % 3 == 0
        assert all(g > 0 for g in r.alone_gaps_ms + r.joined_gaps_ms)
        assert r.newcomer_wall_ttft_ms > 0 and r.newcomer_engine_ttft_ms is not None
    table = format_chunked_table(rounds)
    assert "(median of 2 round(s))" in table and len(table.splitlines()) == 5


def test_a_chunked_round_needs_the_engine_to_itself(tiny_engine) -> None:
    tiny_engine.add([GenerationRequest("busy", prompt="hello", params=SamplingParams(max_new_tokens=8))])
    try:
        with pytest.raises(ChunkedBenchError, match="the engine has rows running"):
            run_chunked_bench(tiny_engine, ChunkedShape(num_rows=2, newcomer_tokens=20, window_steps=2), num_rounds=1)
    finally:
        tiny_engine.cancel(tiny_engine.live_request_ids)


@pytest.mark.parametrize(("argv", "message"), [
    (["prefix", "--baseline", "configs/fp32.yaml", "--candidate", "configs/fp32.yaml"], "both named 'fp32'"),
    (["prefix", "--max-new-tokens", "300"], "--max-new-tokens 300: above a config's decoding.max_new_tokens"),
    (["prefix", "--candidate", "configs/absent.yaml"], "configs/absent.yaml: no such config file"),
    (["chunked", "--rows", "16"], "--rows 16: the rows and the newcomer need 17 rows"),
    (["chunked", "--max-prefill-tokens", "4"], "above the config's decoding.max_new_tokens (256)"),
    (["chunked", "--newcomer-tokens", "2048", "--max-prefill-tokens", "1024"], "--newcomer-tokens 2048: the config's "
                                                                               "decoding.max_context_tokens is 2048"),
])
def test_bad_options_are_refused_by_name_before_anything_starts(argv: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["bench", *argv])
    assert result.exit_code == 2 and message in result.stderr, result.output
