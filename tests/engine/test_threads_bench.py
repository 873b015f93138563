"""bench.threads end to end on the tiny model's shape with random weights (speed only): each config's figures at
every thread count, and the memory's own read stream measured in the same rounds beside them."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from bench import threads
from servelab.outputs import BatchTimings


def test_the_thread_bench_prints_the_memorys_read_stream_beside_each_config(tiny_folder: Path, monkeypatch,
                                                                            capsys) -> None:
    before = torch.get_num_threads()
    monkeypatch.setattr(sys, "argv", ["bench.threads", "--random-weights", str(tiny_folder),
                                      "--configs", str(threads.REPO / "configs/fp32.yaml"), "--threads", "1,2",
                                      "--batch-sizes", "1", "--rounds", "1", "--prompt-tokens", "16", "--new-tokens", "4"])
    try:
        threads.main()
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert re.search(r"^  decode batch 1, tok/s: 1t +[\d.]+ \(x1\.00\) \| 2t +[\d.]+ \(x[\d.]+\)$", out, re.M), out
    stream = re.findall(r"^  memory read stream in the same rounds, GB/s: 1t +([\d.]+) \(x1\.00\) \| 2t +([\d.]+) "
                        r"\(x[\d.]+\)$", out, re.M)
    assert len(stream) == 1 and all(float(gbs) > 0 for gbs in stream[0]), out


def test_decode_is_the_decode_steps_tokens_over_their_time_as_the_engine_timed_them() -> None:
    # a closed batch of 2 rows, 5 tokens each: the prefill made the first of each, 4 decode steps the other 8 in 40 ms
    timings = BatchTimings(prefill_ms=30.0, decode_ms=40.0, num_rows_per_step=(2, 2, 2, 2, 2), num_prefill_tokens=16,
                           num_decode_tokens=8)
    assert timings.decode_tok_s == pytest.approx(8 / 0.040)
    assert BatchTimings(prefill_ms=30.0, decode_ms=0.0, num_rows_per_step=(2,), num_prefill_tokens=16,
                        num_decode_tokens=0).decode_tok_s == 0


def test_the_thread_bench_refuses_fewer_than_two_new_tokens(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["bench.threads", "--new-tokens", "1"])
    with pytest.raises(SystemExit):
        threads.main()
    assert "--new-tokens 1: at least 2" in capsys.readouterr().err
