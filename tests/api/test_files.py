"""Files through the API a part at a time: an upload stored in parts, a download served part by part."""

from __future__ import annotations

import tracemalloc

from sqlalchemy import func, select

from api.batches import _parts
from servelab.store import files
from servelab.store.db import session_scope
from servelab.store.models import FilePartRow, FileRow
from tests.api.conftest import client_for
from tests.jobs.conftest import line


def part_sizes(stack, file_id: str) -> list[int]:
    with session_scope(stack.runtime.sessions) as session:
        return session.scalars(select(func.octet_length(FilePartRow.content)).where(FilePartRow.file_id == file_id)
                               .order_by(FilePartRow.byte_offset)).all()


def test_an_upload_is_stored_in_parts_and_downloaded_whole_with_its_length(make_stack, monkeypatch) -> None:
    monkeypatch.setattr(files, "PART_BYTES", 4_096)
    stack = make_stack(with_worker=False)
    api = client_for(stack, stack.key("acme"))
    content = ("\n".join(line(f"r{i}", "fp32", prompt=f"story {i}") for i in range(300)) + "\n").encode()
    uploaded = api.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", content)}).json()
    assert uploaded["bytes"] == len(content)
    sizes = part_sizes(stack, uploaded["id"])
    assert len(sizes) == -(-len(content) // 4_096) and sizes[:-1] == [4_096] * (len(sizes) - 1)
    downloaded = api.get(f"/v1/files/{uploaded['id']}/content")
    assert downloaded.status_code == 200 and downloaded.content == content
    assert downloaded.headers["content-length"] == str(len(content))


def test_a_refused_upload_leaves_no_file_behind(make_stack, monkeypatch) -> None:
    monkeypatch.setattr(files, "PART_BYTES", 1_024)
    stack = make_stack(with_worker=False, max_batch_lines=50)
    api = client_for(stack, stack.key("acme"))

    def num_files() -> int:
        with session_scope(stack.runtime.sessions) as session:
            return session.scalar(select(func.count()).select_from(FileRow))

    before = num_files()
    too_many = api.post("/v1/files", data={"purpose": "batch"},
                        files={"file": ("big.jsonl", "\n".join(line(f"r{i}", "fp32") for i in range(80)).encode())})
    assert too_many.status_code == 413 and "the file has 80 lines; a batch takes at most 50" in too_many.text
    empty = api.post("/v1/files", data={"purpose": "batch"}, files={"file": ("blank.jsonl", b" \n\n" * 2_000)})
    assert empty.status_code == 400 and empty.json()["error"]["code"] == "empty_file"
    assert num_files() == before


def test_a_download_holds_one_part_at_a_time(make_stack, monkeypatch) -> None:
    monkeypatch.setattr(files, "PART_BYTES", 32 * 1024)
    stack = make_stack(with_worker=False)
    content = b"".join(b"%07d " % i + b"x" * 90 + b"\n" for i in range(20_000))  # 2 MB
    with session_scope(stack.runtime.sessions) as session:
        stored = files.create_file(session, tenant="acme", purpose="batch", filename="big.jsonl", content=content)
    tracemalloc.start()
    try:
        received, largest = 0, 0
        for part in _parts(stack.runtime.sessions, stored):
            received, largest = received + len(part), max(largest, len(part))
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert received == len(content) and largest == files.PART_BYTES
    assert peak_bytes < len(content) / 8, peak_bytes  # a part and a transaction's worth, not the file
