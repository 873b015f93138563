"""The paged KV cache's bookkeeping: which block of the pool each row's tokens sit in, and which full blocks
hold a prefix that another request may share.

A pool of `num_blocks` blocks of `block_size` token columns. Each row has a block table (its blocks in token
order); a row takes a block when it grows past its last one and returns its blocks when it leaves. With prefix
caching on, a full block is keyed by a hash chain over its tokens and every token before it (and a namespace:
the model, its weights and the cache precision, everything else that changes the values a block holds), so a
newcomer whose prompt starts with blocks already computed shares them (a reference count per block) and
prefills only the rest. A block no row holds but whose hash is known stays in the pool, reusable, until a block
is needed and none is free: then the least recently used such block is evicted (its hash forgotten).

With a window (`window=(sink_blocks, window_blocks)`), a row keeps its first sink blocks and, behind the block its
next token goes to, window blocks; the blocks between are dropped as it grows (`evict`), so a row holds at most
sink + window + 1 blocks when it decodes (and a prefill chunk's blocks more while it prefills). A row's table then
lists the blocks it keeps, in token order; its num_evicted_blocks says how many were dropped after the sinks, so
logical block i sits at table index i below the sinks and i - evicted above them.

Pure: no torch. The tensors are kvcache.py's `PagedKVCache`, which a runner reads and writes where a plan says.
The scheduler owns this pool and is the only caller that takes or frees blocks. The tables live on the requests
(`HoldsBlocks`); this class knows requests by nothing but their ids, tables and token ids.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from typing import Protocol, Sequence


class OutOfBlocks(RuntimeError):
    """The pool has no block to give (every block is held by a row)."""


class HoldsBlocks(Protocol):
    """What the pool keeps on a request (the scheduler's ScheduledRequest): its blocks in token order, the chain
    hash of each full block keyed so far, and (window) the logical blocks dropped right after its sinks (table[:sink]
    are logical 0..sink-1)."""

    request_id: str
    block_table: list[int]
    block_hashes: list[bytes]
    num_evicted_blocks: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool, namespace: str = "",
                 window: tuple[int, int] | None = None, chunk_tokens: int = 0) -> None:
        """window: (sink blocks, window blocks) kept per row, the rest evicted as rows grow (None: a row keeps every
        block); chunk_tokens: the most tokens one prefill chunk computes, so a windowed row admitted with a long
        prompt takes only the blocks its first chunks need (sink + window + 1 + a chunk's)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs at least one block of at least one token (got {num_blocks} x {block_size})")
        if window is not None and (window[0] < 0 or window[1] < 1):
            raise ValueError(f"a window keeps at least one block behind the newest (got sink, window = {window})")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.window, self.chunk_tokens = window, chunk_tokens
        self.row_cap = None if window is None else window[0] + window[1] + 1 + self.blocks_for(max(chunk_tokens, 1))
        self._root = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
        self._free = list(range(num_blocks))  # a heap: the lowest id first, so the pool's tensors stay compact
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, least recently used first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._holders: set[str] = set()  # the request ids holding blocks
        self.num_evicted = 0

    # --- what the scheduler and the figures read ---

    @property
    def num_free_blocks(self) -> int:
        """Blocks a row may take now: never used, or cached but held by no row (evicted when taken)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one row (a shared block counted once)."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_shared_blocks(self) -> int:
        return sum(1 for n in self._refs if n > 1)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_kept(self, position: int) -> int:
        """With a window: the first block after the sinks a token at this position attends to."""
        assert self.window is not None
        return max(self.window[0], position // self.block_size - self.window[1])

    def evict(self, seq: HoldsBlocks, position: int, *, cached_tokens: int = 0) -> int:
        """With a window, before the row computes a token at `position` (or a chunk starting there): the blocks
        between its sinks and the first block that token attends to go back to the pool -> how many. A block within
        the first cached_tokens (its prompt) stays cached, findable by a later prompt, until the pool needs it;
        a block of generated tokens is forgotten and free at once (no prompt starts with it: kept cached, freed
        blocks would push the pool's tensors on as far as the pool reaches while the row's own blocks stay flat)."""
        if self.window is None:
            return 0
        sink = self.window[0]
        drop = min(self.first_kept(position) - sink - seq.num_evicted_blocks, len(seq.block_table) - sink)
        if drop <= 0:
            return 0
        dropped = seq.block_table[sink:sink + drop]
        del seq.block_table[sink:sink + drop]
        seq.num_evicted_blocks += drop
        first = sink + seq.num_evicted_blocks - drop  # the logical index of the first dropped block
        for i, block in enumerate(dropped):
            self._drop_ref(block, keep_cached=(first + i + 1) * self.block_size <= cached_tokens)
        return drop

    def _retained_hits(self, hits: list[int], start: int) -> list[bool]:
        """Which of a newcomer's cached prefix blocks it keeps when its prefill starts at column `start`."""
        if self.window is None:
            return [True] * len(hits)
        first = self.first_kept(start)
        return [i < self.window[0] or i >= first for i in range(len(hits))]

    def _fresh(self, num_tokens: int, hits: int, kept: int) -> int:
        """New blocks a newcomer takes for num_tokens columns: with a window no more than its cap."""
        need = self.blocks_for(num_tokens) - hits
        return need if self.row_cap is None else max(0, min(need, self.row_cap - kept))

    def private_blocks(self, seq: HoldsBlocks) -> int:
        """Blocks only this row holds: what its leaving frees."""
        return sum(1 for b in seq.block_table if self._refs[b] == 1)

    def cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The cached blocks a prompt starts with (no side effect). At least the prompt's last token is left to
        compute (its logits are the first token's), so a prompt cached whole shares all but its last block."""
        if not self.prefix_caching:
            return []
        found, parent = [], self._root
        for i in range((len(token_ids) - 1) // self.block_size):
            parent = self._chain(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            block = self._block_of.get(parent)
            if block is None:
                break
            found.append(block)
        return found

    def blocks_to_admit(self, token_ids: Sequence[int]) -> int:
        """New blocks a prompt takes (its prompt and its first generated token), its cached prefix shared: the
        scheduler's admission count. A cached block no row holds is counted: taking it makes it unavailable."""
        hits = self.cached_prefix(token_ids)
        kept = [b for b, k in zip(hits, self._retained_hits(hits, len(hits) * self.block_size)) if k]
        return self._fresh(len(token_ids) + 1, len(hits), len(kept)) + sum(1 for b in kept if self._refs[b] == 0)

    # --- rows ---

    def allocate(self, seq: HoldsBlocks, token_ids: Sequence[int]) -> int:
        """A newcomer's blocks for its prompt: its cached prefix shared, the rest taken; -> tokens cached (the
        prefill starts there). OutOfBlocks when the pool cannot hold it (nothing is taken then)."""
        assert seq.request_id not in self._holders, f"row {seq.request_id} already holds blocks"
        hits = self.cached_prefix(token_ids)
        retained = self._retained_hits(hits, len(hits) * self.block_size)
        need = self._fresh(len(token_ids), len(hits), sum(retained))
        if need + sum(1 for b, k in zip(hits, retained) if k and self._refs[b] == 0) > self.num_free_blocks:
            raise OutOfBlocks(f"{need} blocks needed, {self.num_free_blocks} free")
        seq.block_table, seq.block_hashes, seq.num_evicted_blocks = [], [], 0
        parent = self._root
        for i, (block, kept) in enumerate(zip(hits, retained)):
            parent = self._chain(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            seq.block_hashes.append(parent)
            if kept:
                self._take(block)
                seq.block_table.append(block)
            else:  # NOTE: a window's middle block: its hash carries the chain on, the block is not taken
                seq.num_evicted_blocks += 1
        seq.block_table += [self._take_free() for _ in range(need)]
        self._holders.add(seq.request_id)
        return len(hits) * self.block_size

    def grow(self, seq: HoldsBlocks, num_tokens: int) -> None:
        """Room for num_tokens columns in the row's blocks (OutOfBlocks when none is left: the row keeps what
        it had)."""
        need = self.blocks_for(num_tokens) - len(seq.block_table) - seq.num_evicted_blocks
        if need > self.num_free_blocks:
            raise OutOfBlocks(f"row {seq.request_id} needs {need} more blocks, {self.num_free_blocks} free")
        seq.block_table += [self._take_free() for _ in range(need)]

    def commit(self, seq: HoldsBlocks, token_ids: Sequence[int]) -> None:
        """The row's cache now holds these tokens' keys and values (its prompt and generated tokens so far): its
        full blocks not yet registered are keyed, so later prompts may share them. A block whose hash another
        block already holds stays private (the first stays the one found)."""
        if not self.prefix_caching:
            return
        hashes, evicted = seq.block_hashes, seq.num_evicted_blocks
        parent = hashes[-1] if hashes else self._root
        sink = self.window[0] if self.window is not None else 0
        for i in range(len(hashes), min(len(token_ids) // self.block_size, len(seq.block_table) + evicted)):
            parent = self._chain(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            hashes.append(parent)
            if sink <= i < sink + evicted:
                continue  # NOTE: dropped before it was keyed (a window's middle block): nothing to share
            block = seq.block_table[i if i < sink else i - evicted]
            if parent not in self._block_of and block not in self._hash_of:
                self._block_of[parent], self._hash_of[block] = block, parent

    def free(self, seq: HoldsBlocks) -> int:
        """The row leaves: its blocks' references drop; a cached block no row holds becomes the most recently
        used evictable one (a row's blocks are released last first, so a prompt's head outlives its tail) -> the
        blocks it held."""
        if seq.request_id not in self._holders:
            return 0
        self._holders.discard(seq.request_id)
        held = len(seq.block_table)
        for block in reversed(seq.block_table):  # NOTE: last to first, so of this row's blocks its tail is evicted first
            self._drop_ref(block)
        seq.block_table, seq.block_hashes, seq.num_evicted_blocks = [], [], 0
        return held

    # --- inside ---

    def _drop_ref(self, block: int, *, keep_cached: bool = True) -> None:
        """A row lets go of a block: held by no row, a cached one becomes the most recently used evictable one (or,
        not keep_cached, is forgotten and free at once)."""
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._hash_of and not keep_cached:
                self._forget(block)
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                heapq.heappush(self._free, block)

    def _take(self, block: int) -> None:
        if self._refs[block] == 0:
            self._evictable.pop(block, None)
        self._refs[block] += 1

    def _take_free(self) -> int:
        if self._free:
            block = heapq.heappop(self._free)
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
            self.num_evicted += 1
        else:
            raise OutOfBlocks("no free block")
        self._refs[block] = 1
        return block

    def _forget(self, block: int) -> None:
        digest = self._hash_of.pop(block)
        if self._block_of.get(digest) == block:
            del self._block_of[digest]

    def _chain(self, parent: bytes, tokens: Sequence[int]) -> bytes:
        return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()
