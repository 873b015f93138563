"""Workloads: same file, same requests and arrivals; fingerprints tell workloads apart; bad files named."""

from __future__ import annotations

from pathlib import Path

import pytest

from servelab.analysis.workload import WorkloadError, builtin_prompts, load_workload, system_prompt

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((REPO / "workloads").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_workloads_load(path: Path) -> None:
    workload = load_workload(path)
    assert workload.items and workload.name == path.stem


def write(tmp_path: Path, text: str, name: str = "w.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_same_workload_replays_identically(tmp_path: Path) -> None:
    text = "prompts: {set: chat, num_prompts: 12, seed: 3}\narrival: {process: poisson, rate_per_s: 4, seed: 9}\n"
    a, b = load_workload(write(tmp_path, text, "a.yaml")), load_workload(write(tmp_path, text, "b.yaml"))
    assert a.items == b.items and a.fingerprint == b.fingerprint
    offsets = [it.offset_s for it in a.items]
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and len(set(offsets)) == 12


@pytest.mark.parametrize("change", [
    "prompts: {set: chat, num_prompts: 12, seed: 4}\n",  # other prompts
    "prompts: {set: chat, num_prompts: 12, seed: 3}\nmax_new_tokens: 8\n",  # other lengths
    "prompts: {set: chat, num_prompts: 12, seed: 3}\narrival: {process: poisson, rate_per_s: 4, seed: 10}\n",
    "prompts: {set: chat, num_prompts: 12, seed: 3}\narrival: {process: burst}\n",
])
def test_fingerprint_changes_with_prompts_lengths_or_arrivals(tmp_path: Path, change: str) -> None:
    base = load_workload(write(tmp_path, "prompts: {set: chat, num_prompts: 12, seed: 3}\n"
                                         "arrival: {process: poisson, rate_per_s: 4, seed: 9}\n", "a.yaml"))
    assert load_workload(write(tmp_path, change, "b.yaml")).fingerprint != base.fingerprint


def test_a_prompt_file_with_per_prompt_caps(tmp_path: Path) -> None:
    (tmp_path / "p.jsonl").write_text('{"prompt": "hello", "max_new_tokens": 5}\n\n'
                                      '{"messages": [{"role": "user", "content": "hi"}]}\n')
    workload = load_workload(write(tmp_path, "prompts: {file: p.jsonl, num_prompts: 4, chat: false}\n"
                                             "max_new_tokens: 9\narrival: {process: closed, num_clients: 2}\n"))
    caps = sorted((it.prompt or "", it.messages is not None, it.max_new_tokens) for it in workload.items)
    assert caps == [("", True, 9), ("", True, 9), ("hello", False, 5), ("hello", False, 5)]
    assert all(it.offset_s is None for it in workload.items)


@pytest.mark.parametrize(("text", "lines", "message"), [
    ("prompts: {set: chat}\narrival: {process: trickle}\n", None, "arrival.process: got 'trickle'"),
    ("prompts: {set: chat, file: x.jsonl}\n", None, "exactly one of 'set'"),
    ("prompts: {file: p.jsonl}\n", "not json\n", "p.jsonl:1: not valid JSON"),
    ("prompts: {file: p.jsonl}\n", '{"prompt": "a"}\n{"text": "b"}\n', "p.jsonl:2: each line needs a 'prompt'"),
    ("prompts: {file: p.jsonl}\n", '{"prompt": "a", "max_new_tokens": -3}\n', "max_new_tokens must be a positive"),
    ("prompts: {file: missing.jsonl}\n", None, "no such file"),
    ("prompts: {set: chat}\nmax_new_tokens: 0\n", None, "max_new_tokens: got 0"),
    ("prompts: {set: chat}\nspeed: 3\n", None, "speed: unknown field"),
])
def test_bad_workload_files_are_named(tmp_path: Path, text: str, lines: str | None, message: str) -> None:
    if lines is not None:
        (tmp_path / "p.jsonl").write_text(lines)
    with pytest.raises(WorkloadError, match=message.replace("(", r"\(").replace("'", "'")):
        load_workload(write(tmp_path, text))


def test_a_bulk_backlog_comes_at_the_start_with_mixed_seeded_lengths(tmp_path: Path) -> None:
    base = "prompts: {set: chat, num_prompts: 4, seed: 3}\nmax_new_tokens: 8\n"
    text = base + "bulk: {num_requests: 20, min_new_tokens: 5, max_new_tokens: 60, seed: 1}\n"
    workload = load_workload(write(tmp_path, text))
    interactive, bulk = workload.items[:4], workload.items[4:]
    assert not any(it.is_bulk for it in interactive) and all(it.is_bulk for it in bulk) and len(bulk) == 20
    assert [it.index for it in workload.items] == list(range(24))
    assert all(it.offset_s == 0.0 and 5 <= it.max_new_tokens <= 60 for it in bulk)
    assert len({it.max_new_tokens for it in bulk}) > 5  # mixed lengths
    assert all(it.sampling(workload.spec).ignore_eos for it in bulk)  # each decodes exactly its drawn length
    assert not interactive[0].sampling(workload.spec).ignore_eos
    assert load_workload(write(tmp_path, text, "again.yaml")).items == workload.items
    other = load_workload(write(tmp_path, text.replace("seed: 1", "seed: 2"), "other.yaml"))
    assert other.fingerprint != workload.fingerprint
    assert load_workload(write(tmp_path, base, "none.yaml")).fingerprint != workload.fingerprint


def test_a_bulk_range_upside_down_is_named(tmp_path: Path) -> None:
    text = "prompts: {set: chat}\nbulk: {num_requests: 2, min_new_tokens: 50, max_new_tokens: 10}\n"
    with pytest.raises(WorkloadError, match="min_new_tokens \\(50\\) is above max_new_tokens \\(10\\)"):
        load_workload(write(tmp_path, text))


def test_a_shared_system_prompt_opens_every_prompt_bulk_ones_too(tmp_path: Path) -> None:
    (tmp_path / "desk.txt").write_text("You answer for the desk.\n")
    text = ("prompts: {set: library, num_prompts: 5, seed: 1, system: {file: desk.txt}}\n"
            "bulk: {num_requests: 7, min_new_tokens: 2, max_new_tokens: 9, seed: 2}\n")
    workload = load_workload(write(tmp_path, text))
    assert len(workload.items) == 12 and sum(it.is_bulk for it in workload.items) == 7
    assert all(it.messages[0] == {"role": "system", "content": "You answer for the desk."} for it in workload.items)
    assert all(it.messages[1]["role"] == "user" and it.messages[1]["content"] in builtin_prompts("library")
               for it in workload.items)
    (tmp_path / "desk.txt").write_text("You answer for the other desk.\n")
    assert load_workload(write(tmp_path, text, "other.yaml")).fingerprint != workload.fingerprint
    plain = load_workload(write(tmp_path, text.replace(", system: {file: desk.txt}", ""), "plain.yaml"))
    assert [it.messages[1:] for it in workload.items] == [it.messages for it in plain.items]


def test_the_built_in_system_prompt_is_the_shipped_workloads_and_the_benches_prefix() -> None:
    workload = load_workload(REPO / "workloads" / "shared-prefix.yaml")
    text = system_prompt("library")
    assert all(it.messages[0] == {"role": "system", "content": text} for it in workload.items)
    assert workload.spec.bulk is not None and any(not it.is_bulk for it in workload.items)
    assert "Examples of good answers" in text and len(text.split()) > 300  # instructions and worked examples
    questions = builtin_prompts("library")
    assert len(questions) == len(set(questions)) == 64
    with pytest.raises(WorkloadError, match="no built-in system prompt 'desk'; built-in: library"):
        system_prompt("desk")


@pytest.mark.parametrize(("system", "files", "message"), [
    ("{set: library, file: desk.txt}", {}, "exactly one of 'set' \\(built-in: library\\)"),
    ("{set: desk}", {}, "prompts.system.set: got 'desk'"),
    ("{file: missing.txt}", {}, "prompts.system.file: no such file"),
    ("{file: desk.txt}", {"desk.txt": " \n"}, "desk.txt holds no text"),
    ("{file: desk.txt}", {"desk.txt": b"\xff\xfe"}, "desk.txt is not UTF-8 text"),
    ("{file: desk.txt}", {"desk.txt": "Be kind.", "p.jsonl": '{"prompt": "a"}\n{"messages": [{"role": "system", '
                          '"content": "x"}, {"role": "user", "content": "b"}]}\n'},
     "p.jsonl: prompt 2 has a system message of its own"),
])
def test_a_bad_system_prompt_is_named(tmp_path: Path, system: str, files: dict, message: str) -> None:
    for name, content in files.items():
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    source = "file: p.jsonl" if "p.jsonl" in files else "set: chat"
    with pytest.raises(WorkloadError, match=message):
        load_workload(write(tmp_path, f"prompts: {{{source}, system: {system}}}\n"))


def test_a_system_prompt_needs_the_chat_template(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="system needs chat: true"):
        load_workload(write(tmp_path, "prompts: {set: chat, chat: false, system: {set: library}}\n"))
