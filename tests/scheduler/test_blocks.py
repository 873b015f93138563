"""The paged pool's books on their own: sharing, reference counts, least-recently-used eviction, and (with a
window) middle blocks freed while cached ones stay findable. No torch, no model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from servelab.scheduler.blocks import BlockManager, OutOfBlocks


def row_(name: str) -> SimpleNamespace:
    """A request as the pool sees it (HoldsBlocks)."""
    return SimpleNamespace(request_id=name, block_table=[], block_hashes=[], num_evicted_blocks=0)


def num_cached(books: BlockManager) -> int:
    """Blocks whose hash is known (held or evictable): what a newcomer may find."""
    return len(books._hash_of)


def test_a_prompt_shares_the_full_blocks_another_computed_and_only_those() -> None:
    a, b = row_("a"), row_("b")
    books = BlockManager(10, 4, prefix_caching=True)
    first = list(range(100, 111))  # 11 tokens: two full blocks and 3 columns of a third
    assert books.allocate(a, first) == 0 and len(a.block_table) == 3
    books.commit(a, first)
    # the same 8 tokens, then another tail: a prefix ending mid-block shares the two full blocks only
    second = first[:8] + [7, 7, 7, 7, 7]
    assert books.cached_prefix(second) == a.block_table[:2]
    assert books.blocks_to_admit(second) == 2  # 14 tokens + its first generated one: 4 blocks, 2 of them shared
    assert books.allocate(b, second) == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert books.num_shared_blocks == 2 and books.num_used_blocks == 3 + 2
    assert books.private_blocks(a) == 1 and books.private_blocks(b) == 2
    books.free(a)
    assert books.num_used_blocks == 4 and books.num_shared_blocks == 0  # b still holds the two shared ones


def test_a_prompt_cached_whole_still_computes_its_last_token() -> None:
    a, b = row_("a"), row_("b")
    books = BlockManager(10, 4, prefix_caching=True)
    prompt = list(range(8))
    books.allocate(a, prompt)
    books.commit(a, prompt)
    books.free(a)
    # both blocks are cached, but the last token's logits are needed: its block is computed again, privately
    assert books.allocate(b, prompt) == 4
    assert b.block_table[0] != b.block_table[1]


def test_unreferenced_cached_blocks_are_evicted_least_recently_used_first() -> None:
    x, y = row_("x"), row_("y")
    books = BlockManager(6, 2, prefix_caching=True)
    old, new = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]  # 3 blocks each: 2 full (cached) and a partial one
    for row, prompt in ((row_("old"), old), (row_("new"), new)):
        books.allocate(row, prompt)
        books.commit(row, prompt)
        books.free(row)
    assert books.num_free_blocks == 6 and num_cached(books) == 4
    books.allocate(x, list(range(20, 27)))  # 4 blocks: the 2 never cached, then the 2 least recently used
    assert books.num_evicted == 2
    assert books.cached_prefix(old) == [] and len(books.cached_prefix(new)) == 2
    with pytest.raises(OutOfBlocks):
        books.allocate(y, list(range(30, 39)))  # 5 blocks: only 2 can be found
    assert y.block_table == [] and num_cached(books) == 2  # a refused allocation took nothing


def test_prefix_caching_off_shares_nothing_and_a_row_grows_block_by_block() -> None:
    a = row_("a")
    books = BlockManager(6, 4, prefix_caching=False)
    books.allocate(a, [1, 2, 3, 4, 5])
    books.commit(a, [1, 2, 3, 4, 5])
    assert books.cached_prefix([1, 2, 3, 4, 5]) == [] and num_cached(books) == 0
    books.grow(a, 8)
    assert len(a.block_table) == 2
    books.grow(a, 9)
    assert len(a.block_table) == 3
    books.free(a)
    assert books.num_free_blocks == 6


# --- with a window ---

def test_a_row_keeps_its_sinks_and_window_and_frees_the_blocks_between() -> None:
    a = row_("a")
    books = BlockManager(20, 4, prefix_caching=True, window=(1, 2))
    prompt = list(range(100, 110))  # 10 tokens: blocks 0, 1, 2 (half full)
    books.allocate(a, prompt)
    books.commit(a, prompt)
    first = list(a.block_table)
    assert books.evict(a, 10) == 0  # position 10 is in block 2: the window (blocks 0-2) still holds every block
    books.grow(a, 21)  # decode up to position 20: logical blocks 0..5
    assert books.evict(a, 20, cached_tokens=10) == 2  # position 20 is block 5: it sees block 0 (sink) and blocks 3, 4, 5
    assert a.block_table[0] == first[0] and len(a.block_table) == 4 and a.num_evicted_blocks == 2
    assert books.num_used_blocks == 4 and num_cached(books) == 2  # the freed full blocks stay findable
    assert books.cached_prefix(prompt + [1, 2, 3]) == first[:2]
    books.grow(a, 22)
    assert len(a.block_table) == 4  # the same block goes on filling
    assert books.evict(a, 24) == 1 and books.grow(a, 25) is None and len(a.block_table) == 4  # flat
    books.free(a)
    assert books.num_used_blocks == 0


def test_a_long_row_reuses_the_blocks_it_freed_so_the_pool_stays_compact() -> None:
    a = row_("a")
    books = BlockManager(100, 4, prefix_caching=True, window=(1, 2))
    tokens = list(range(1000, 1400))
    books.allocate(a, tokens[:5])
    highest = 0
    for n in range(5, 400):  # decode 395 tokens after a 5-token prompt: evict, grow, commit, as the engine does
        books.evict(a, n, cached_tokens=5)
        books.grow(a, n + 1)
        books.commit(a, tokens[:n + 1])
        highest = max(highest, *a.block_table)
    assert len(a.block_table) == 4 and highest < 1 + 2 + 1 + 1  # freed blocks taken again, not fresh ones
    assert num_cached(books) == 4 and books.num_evicted == 0  # only the held blocks: freed ones were forgotten


def test_a_long_cached_prompt_takes_only_the_blocks_its_window_keeps() -> None:
    a, b = row_("a"), row_("b")
    books = BlockManager(40, 4, prefix_caching=True, window=(1, 2), chunk_tokens=8)
    prompt = list(range(200, 241))  # 41 tokens: 10 full blocks and one token
    books.allocate(a, prompt)
    assert len(a.block_table) == books.row_cap == 1 + 2 + 1 + 2  # a long prompt's first chunks only
    books.free(a)
    computed = BlockManager(40, 4, prefix_caching=True, window=(1, 2), chunk_tokens=8)
    computed.allocate(a, prompt[:8])
    computed.commit(a, prompt[:8])
    for end in range(12, 41, 4):  # the prompt computed chunk by chunk, the window evicting as it goes
        computed.evict(a, end - 4, cached_tokens=len(prompt))
        computed.grow(a, end)
        computed.commit(a, prompt[:end])
    assert a.num_evicted_blocks == 10 - 1 - 2 - 1
    computed.free(a)
    # every full block was keyed before the window dropped it: freed to the least-recently-used end, all findable
    assert len(computed.cached_prefix(prompt)) == 10
    free = computed.num_free_blocks
    assert computed.blocks_to_admit(prompt) == 1 + 2 + 1  # the sink and the window's cached blocks, one fresh
    assert computed.allocate(b, prompt) == 40 and b.num_evicted_blocks == 10 - 1 - 2
    assert len(b.block_table) == 1 + 2 + 1  # sink, blocks 8 and 9, and the block position 40 goes to
    assert computed.num_free_blocks == free - 4  # the middle blocks were not taken
