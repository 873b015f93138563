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
lists the blocks it keeps, in token order; `evicted(row)` says how many were dropped after the sinks, so logical
block i sits at table index i below the sinks and i - evicted above them.

Pure: no torch. The tensors are kvcache.py's `PagedKVCache`; the scheduler reads the room left through the
`KVRoom` view it is handed (servelab.scheduler). Does not know requests beyond their ids and token ids.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence


class OutOfBlocks(RuntimeError):
    """The pool has no block to give (every block is held by a row)."""


@dataclass
class _RowBlocks:
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # the chain hash of each full block registered so far
    evicted: int = 0  # window: logical blocks dropped right after the sink blocks (blocks[:sink] are logical 0..sink-1)

    @property
    def num_logical(self) -> int:
        return len(self.blocks) + self.evicted


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
        self.window = window
        self.row_cap = None if window is None else window[0] + window[1] + 1 + self.blocks_for(max(chunk_tokens, 1))
        self._root = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
        self._free = list(range(num_blocks))  # a heap: the lowest id first, so the pool's tensors stay compact
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, least recently used first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._rows: dict[str, _RowBlocks] = {}
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
    def num_cached_blocks(self) -> int:
        """Blocks whose hash is known (held or evictable): what a newcomer may find."""
        return len(self._hash_of)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, row: str) -> list[int]:
        """The blocks the row keeps, in token order (with a window: the sinks, then the window's)."""
        return self._rows[row].blocks

    def evicted(self, row: str) -> int:
        """Logical blocks the row dropped after its sink blocks (0 without a window)."""
        return self._rows[row].evicted

    def first_kept(self, position: int) -> int:
        """With a window: the first block after the sinks a token at this position attends to."""
        assert self.window is not None
        return max(self.window[0], position // self.block_size - self.window[1])

    def evict(self, row: str, position: int, *, cached_tokens: int = 0) -> int:
        """With a window, before the row computes a token at `position` (or a chunk starting there): the blocks
        between its sinks and the first block that token attends to go back to the pool -> how many. A block within
        the first cached_tokens (its prompt) stays cached, findable by a later prompt, until the pool needs it;
        a block of generated tokens is forgotten and free at once (no prompt starts with it: kept cached, freed
        blocks would push the pool's tensors on as far as the pool reaches while the row's own blocks stay flat)."""
        if self.window is None:
            return 0
        state, sink = self._rows[row], self.window[0]
        drop = min(self.first_kept(position) - sink - state.evicted, len(state.blocks) - sink)
        if drop <= 0:
            return 0
        dropped = state.blocks[sink:sink + drop]
        del state.blocks[sink:sink + drop]
        state.evicted += drop
        first = sink + state.evicted - drop  # the logical index of the first dropped block
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

    def holds(self, row: str) -> bool:
        return row in self._rows

    def private_blocks(self, row: str) -> int:
        """Blocks only this row holds: what its leaving frees."""
        return sum(1 for b in self._rows[row].blocks if self._refs[b] == 1) if row in self._rows else 0

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

    def allocate(self, row: str, token_ids: Sequence[int]) -> int:
        """A newcomer's blocks for its prompt: its cached prefix shared, the rest taken; -> tokens cached (the
        prefill starts there). OutOfBlocks when the pool cannot hold it (nothing is taken then)."""
        assert row not in self._rows, f"row {row} already holds blocks"
        hits = self.cached_prefix(token_ids)
        retained = self._retained_hits(hits, len(hits) * self.block_size)
        need = self._fresh(len(token_ids), len(hits), sum(retained))
        if need + sum(1 for b, k in zip(hits, retained) if k and self._refs[b] == 0) > self.num_free_blocks:
            raise OutOfBlocks(f"{need} blocks needed, {self.num_free_blocks} free")
        state = _RowBlocks()
        parent = self._root
        for i, (block, kept) in enumerate(zip(hits, retained)):
            parent = self._chain(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            state.hashes.append(parent)
            if kept:
                self._take(block)
                state.blocks.append(block)
            else:  # NOTE: a window's middle block: its hash carries the chain on, the block is not taken
                state.evicted += 1
        state.blocks += [self._take_free() for _ in range(need)]
        self._rows[row] = state
        return len(hits) * self.block_size

    def grow(self, row: str, num_tokens: int) -> None:
        """Room for num_tokens columns in the row's blocks (OutOfBlocks when none is left: the row keeps what
        it had)."""
        state = self._rows[row]
        need = self.blocks_for(num_tokens) - state.num_logical
        if need > self.num_free_blocks:
            raise OutOfBlocks(f"row {row} needs {need} more blocks, {self.num_free_blocks} free")
        state.blocks += [self._take_free() for _ in range(need)]

    def step_blocks(self, rows: Sequence[tuple[str, int]]) -> int:
        """New blocks these (row, columns it will hold) need: the next step's demand."""
        return sum(max(0, self.blocks_for(n) - self._rows[r].num_logical) for r, n in rows if r in self._rows)

    def commit(self, row: str, token_ids: Sequence[int]) -> None:
        """The row's cache now holds these tokens' keys and values (its prompt and generated tokens so far): its
        full blocks not yet registered are keyed, so later prompts may share them. A block whose hash another
        block already holds stays private (the first stays the one found)."""
        if not self.prefix_caching:
            return
        state = self._rows[row]
        parent = state.hashes[-1] if state.hashes else self._root
        sink = self.window[0] if self.window is not None else 0
        for i in range(len(state.hashes), min(len(token_ids) // self.block_size, state.num_logical)):
            parent = self._chain(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            state.hashes.append(parent)
            if sink <= i < sink + state.evicted:
                continue  # NOTE: dropped before it was keyed (a window's middle block): nothing to share
            block = state.blocks[i if i < sink else i - state.evicted]
            if parent not in self._block_of and block not in self._hash_of:
                self._block_of[parent], self._hash_of[block] = block, parent

    def free(self, row: str) -> None:
        """The row leaves: its blocks' references drop; a cached block no row holds becomes the most recently
        used evictable one (a row's blocks are released last first, so a prompt's head outlives its tail)."""
        state = self._rows.pop(row, None)
        if state is None:
            return
        for block in reversed(state.blocks):  # NOTE: last to first, so of this row's blocks its tail is evicted first
            self._drop_ref(block)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no row holds; -> how many were dropped."""
        dropped = list(self._evictable)
        for block in dropped:
            self._forget(block)
            heapq.heappush(self._free, block)
        self._evictable.clear()
        return len(dropped)

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
