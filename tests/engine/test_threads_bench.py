"""bench.threads end to end on the tiny model's shape with random weights (speed only): each config's figures at
every thread count, and the memory's own read stream measured in the same rounds beside them."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from bench import threads
from servelab.outputs import Completion


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


def test_decode_is_timed_from_the_batchs_last_first_token_to_its_last_token_in_one_run() -> None:
    def row(started_s: float, times_ms: tuple[float, ...]) -> Completion:
        return Completion("r", "", tuple(range(len(times_ms))), 8, "length", started_at_s=started_s,
                          token_times_ms=times_ms)

    # two rows started 5 ms apart: decode runs from the later first token (1000.020 s) to the last (1000.060 s)
    rows = [row(1000.0, (15.0, 25.0, 35.0, 45.0, 55.0)), row(1000.005, (15.0, 25.0, 35.0, 45.0, 55.0))]
    assert threads.decode_tok_s(rows) == pytest.approx(8 / 0.040)
    with pytest.raises(ValueError, match="no decode steps to time"):
        threads.decode_tok_s([row(1000.0, (15.0,))])


def test_the_thread_bench_refuses_fewer_than_two_new_tokens(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["bench.threads", "--new-tokens", "1"])
    with pytest.raises(SystemExit):
        threads.main()
    assert "--new-tokens 1: at least 2" in capsys.readouterr().err
