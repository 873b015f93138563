"""The weight arena: the tensors a decode step streams, moved in place onto one buffer on transparent huge pages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from servelab.engine.arena import arena_bytes, gather_on_huge_pages, huge_pages_mode
from servelab.engine.engine import Engine
from servelab.engine.measure import tensor_storage_bytes
from servelab.request import GenerationRequest, SamplingParams
from servelab.settings import Settings
from tests.engine.conftest import make_config

HUGE = huge_pages_mode() in ("always", "madvise")
# NOTE: where the kernel compacts memory for advised regions at fault time (defrag always, madvise or defer+madvise),
# an advised arena is backed by huge pages at once; with defer or never, maybe only later
DEFRAG = huge_pages_mode(Path("/sys/kernel/mm/transparent_hugepage/defrag"))
AT_FAULT = DEFRAG in ("always", "madvise", "defer+madvise")


@pytest.mark.parametrize(("text", "mode"), [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                                             ("always madvise [never]\n", "never"), ("garbled", None)])
def test_huge_pages_mode_reads_the_bracketed_choice(tmp_path: Path, text: str, mode: str | None) -> None:
    path = tmp_path / "enabled"
    path.write_text(text)
    assert huge_pages_mode(path) == mode
    assert huge_pages_mode(tmp_path / "absent") is None


def test_gathering_moves_every_tensor_and_every_sharer_onto_one_storage() -> None:
    """Values unchanged; tensors sharing a storage (a view, a tied table held elsewhere) still share it, in the arena;
    the old storages are not kept alive by the tensors; the byte count is what the arena holds, not its slack."""
    torch.manual_seed(0)
    a = torch.randn(1024, 1024)  # 4 MB: the arena spans several huge pages
    b = torch.randint(0, 255, (3000,), dtype=torch.uint8)
    view = a[3:7, 10:20]  # a strided view of a's storage, offset and strides kept
    tied = a.view(-1)  # another holder of a's storage, passed only as a sharer
    c = torch.randn(100, dtype=torch.float64)
    expected = [x.clone() for x in (a, b, view, c)]
    before = tensor_storage_bytes([a, b, c])
    old = a.untyped_storage().data_ptr()

    arena = gather_on_huge_pages([a, b, view, c], sharing=[tied, torch.randn(3)])
    if not HUGE:
        assert arena is None  # transparent huge pages are off or absent here: nothing moved
        assert a.untyped_storage().data_ptr() == old
        return
    assert arena is not None and arena.num_tensors == 5 and arena.mode == huge_pages_mode()
    for got, want in zip((a, b, view, c), expected):
        assert torch.equal(got, want)
    storages = {t.untyped_storage().data_ptr() for t in (a, b, view, c, tied)}
    assert len(storages) == 1 and old not in storages
    assert view.stride() == (1024, 1) and view.data_ptr() == a.data_ptr() + (3 * 1024 + 10) * 4
    assert tied.data_ptr() == a.data_ptr()
    assert arena.num_bytes >= before and arena.num_bytes - before < 3 * 64  # each storage aligned to a cache line
    assert tensor_storage_bytes([a, b, c]) == arena.num_bytes == arena_bytes(a.untyped_storage())
    assert a.untyped_storage().nbytes() > arena.num_bytes  # the buffer's slack is not counted
    if AT_FAULT:
        assert arena.huge_page_bytes > 0, "madvise(MADV_HUGEPAGE) was accepted but no huge page backs the arena"
    a.add_(1.0)  # still writable, and the view and the sharer see it
    assert torch.equal(view, expected[2] + 1.0) and torch.equal(tied[:5], expected[0].view(-1)[:5] + 1.0)


# NOTE: in a process of its own, so that glibc's heap is in this state and no other
REUSED_HEAP = """
import torch
from servelab.engine.arena import gather_on_huge_pages
big = torch.empty(24 * 2**20, dtype=torch.uint8); big.fill_(1); del big  # freed: glibc's mmap threshold rises past 8 MB
warm = torch.empty(12 * 2**20, dtype=torch.uint8); warm.fill_(1); del warm  # heap pages faulted in, then freed
print(gather_on_huge_pages([torch.randn(1024, 1024)]).huge_page_bytes)
"""


@pytest.mark.skipif(not HUGE, reason="transparent huge pages are off or absent here")
def test_an_arena_is_on_huge_pages_after_the_heap_served_and_freed_blocks_of_its_size() -> None:
    """An arena on memory glibc's heap had already faulted in on 4 KB pages got no huge page (MADV_HUGEPAGE does not
    replace resident pages at once): a suite's process that had freed large tensors before came out with none."""
    if not AT_FAULT:
        pytest.skip(f"huge pages come at fault time only with defrag always, madvise or defer+madvise (here {DEFRAG})")
    out = subprocess.run([sys.executable, "-c", REUSED_HEAP], check=True, capture_output=True, text=True).stdout
    assert int(out.split()[-1]) > 0


def test_nothing_to_gather_is_no_arena() -> None:
    assert gather_on_huge_pages([]) is None
    assert gather_on_huge_pages([torch.empty(0)]) is None


# NOTE: 'torch' serves F.linear on the checkpoint's own tensors: transformers' parameters share the decoder's storage
@pytest.mark.parametrize("linear_kernel", ["auto", "torch"])
@torch.inference_mode()
def test_an_engine_on_huge_pages_serves_what_it_serves_without(tiny_folder: Path, settings: Settings,
                                                                linear_kernel: str) -> None:
    """The same greedy tokens with and without the arena, the same weight figures, and one copy of the weights
    (transformers' parameters the decoder reads in place, the tied embedding, moved with the decoder's)."""
    config = make_config(str(tiny_folder), linear_kernel=linear_kernel)
    plain = Engine.from_config(config, settings.model_copy(update={"huge_pages": False}))
    arena = Engine.from_config(config, settings.model_copy(update={"huge_pages": True}))
    assert plain.arena is None
    assert (arena.arena is not None) == HUGE
    assert (arena.weight_bytes, arena.step_weight_bytes) == (plain.weight_bytes, plain.step_weight_bytes)
    if arena.arena is not None:
        step = {t.untyped_storage().data_ptr() for t in arena.decoder.step_tensors() if t.layout == torch.strided}
        assert step == {arena.arena.buffer.untyped_storage().data_ptr()}
        held = {t.untyped_storage().data_ptr() for t in arena.decoder.tensors() if t.layout == torch.strided}
        model = [t for t in (*arena.loaded.model.parameters(), *arena.loaded.model.buffers()) if t.numel()]
        assert all(t.untyped_storage().data_ptr() in held for t in model), "a second copy was kept"
        assert arena.weight_bytes == tensor_storage_bytes(arena.decoder.tensors() + model)
    requests = [GenerationRequest(f"r{i}", prompt=p, params=SamplingParams(max_new_tokens=12, ignore_eos=True))
                for i, p in enumerate(["The capital of France is", "One, two, three,", "def add(a, b):"])]
    tokens = [[list(c.token_ids) for c in engine.generate(requests).completions] for engine in (plain, arena)]
    assert tokens[0] == tokens[1]
