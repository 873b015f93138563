"""Decode steps replayed from CUDA graphs: a step of only decode rows, read through FlexAttention, runs at a padded batch
size (paged_attention.padded_rows) from buffers of that size, so its hundreds of kernel launches are captured once per
size and replayed as one. Padded rows write their key into the pool's scratch block (PagedKVCache.scratch_block, named
by no table) and read only it; their logits are dropped.

The step is the decoder's own forward over the buffers (the same code as an eager step); what a graph cannot hold stays
outside it: positions are checked on the host first, sampling runs after. Off CUDA the same buffers and forward run
without a graph (how the CPU checks the padding, the scratch block and the buffers' updates). A size whose capture
fails (a kernel that cannot be captured) runs eagerly from then on, with the reason kept. Does not know plans' rows
beyond their tokens, positions and block tables.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from servelab.engine.decoder import PagedBatch
from servelab.engine.kvcache import PagedKVCache, padded_tables
from servelab.engine.paged_attention import MIN_ROWS, first_line, padded_rows

log = logging.getLogger(__name__)


@dataclass
class _Size:
    """One padded size's input buffers, its captured graph (None: eager) and the logits its replay writes."""

    batch: PagedBatch
    graph: object | None = None
    logits: torch.Tensor | None = None


class DecodeGraphs:
    """Decode-only steps of up to max_rows rows over one pool: captured as CUDA graphs (capture True), else run eagerly
    from the same buffers."""

    def __init__(self, decoder, cache: PagedKVCache, *, max_rows: int, capture: bool) -> None:
        assert decoder.paged_attention == "flex" and decoder.fuses_every_layer, "graphs replay FlexAttention steps"
        self.decoder, self.cache, self.max_rows, self.capture = decoder, cache, max_rows, capture
        self.width = decoder.flex(cache.block_size).width(cache.num_blocks + 1)
        self._sizes: dict[int, _Size] = {}
        self._pool = None  # the graphs' shared memory pool (CUDA)
        self.failed: dict[int, str] = {}  # padded size -> why its capture failed (it runs eagerly)

    def fits(self, num_rows: int, tables: list[list[int]]) -> bool:
        return 0 < num_rows and padded_rows(num_rows) <= self.max_rows and all(len(t) <= self.width for t in tables)

    def run(self, token_ids: list[int], positions: list[int], lengths: list[int],
            tables: list[list[int]]) -> torch.Tensor:
        """One decode step: each row's last token at its position, its new key at column lengths[b] of its table ->
        logits (B, V), valid until the next step."""
        B = len(token_ids)
        if positions and max(positions) >= self.decoder.cos.shape[0]:
            self.decoder._check_positions(torch.tensor(positions))  # raises: the decoder's own message
        size = self._size(padded_rows(B))
        pad = padded_rows(B) - B
        batch = size.batch
        batch.input_ids.copy_(torch.tensor([*token_ids, *[0] * pad]), non_blocking=True)
        batch.positions.copy_(torch.tensor([*positions, *[0] * pad]), non_blocking=True)
        batch.lengths.copy_(torch.tensor([*lengths, *[0] * pad]), non_blocking=True)
        batch.block_table.copy_(padded_tables([*tables, *[[]] * pad], self.width, self.cache.scratch_block),
                                non_blocking=True)
        if size.graph is not None:
            size.graph.replay()
            return size.logits[:B]
        return self.step(size.batch)[:B]

    def step(self, batch: PagedBatch) -> torch.Tensor:
        """What a graph captures, and an eager step runs: the decoder's forward over a padded size's buffers ->
        logits (rows, V). It reads no value back to the host (positions are checked before it) and makes no tensor from
        host data (the buffers are filled before it): a capture refuses both."""
        return self.decoder.forward_paged(batch, self.cache, positions_checked=True)

    def prepare(self, max_rows: int) -> list[int]:
        """Build every padded size a step of up to max_rows rows takes (within this object's max_rows) before serving,
        so that no step waits on a compile or a capture: on CUDA each is captured (its warm-up steps compile
        FlexAttention), else one eager step of padded rows runs (they write only the scratch block) -> the sizes."""
        self.cache.reach([], expected=self.cache.num_blocks)  # NOTE: a token-major pool is allocated whole, at once
        sizes = []
        rows, largest = MIN_ROWS, min(self.max_rows, padded_rows(max_rows))
        while rows <= largest:
            fresh = rows not in self._sizes
            size = self._size(rows)
            if fresh and not self.capture:
                self.step(size.batch)
            sizes.append(rows)
            rows *= 2
        return sizes

    def _size(self, rows: int) -> _Size:
        if rows not in self._sizes:
            device = self.cache.device
            longs = dict(dtype=torch.long, device=device)
            batch = PagedBatch(torch.zeros(rows, **longs), torch.zeros(rows, **longs),
                               torch.full((rows, self.width), self.cache.scratch_block, dtype=torch.int32, device=device),
                               rows, (), torch.arange(rows, device=device), lengths=torch.zeros(rows, **longs))
            size = self._sizes[rows] = _Size(batch)
            if self.capture:
                self._capture(rows, size)
        return self._sizes[rows]

    def _capture(self, rows: int, size: _Size) -> None:
        """Capture the step at this size: two eager steps first on a side stream (FlexAttention compiles, the
        allocator settles; their errors are the step's own, raised), every row padded (they touch only the scratch
        block)."""
        device = self.cache.device
        serving = torch.cuda.current_stream(device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(serving)
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.step(size.batch)
        serving.wait_stream(stream)
        try:
            graph = torch.cuda.CUDAGraph()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._pool):
                size.logits = self.step(size.batch)
            size.graph = graph
        except Exception as exc:  # noqa: BLE001 - NOTE: a kernel that cannot be captured (CUDA's errors, Triton's own
            # exceptions): this size runs eagerly, said once
            torch.cuda.set_stream(serving)  # NOTE: a capture that failed at its end leaves its own stream current
            self.failed[rows] = first_line(exc)
            size.graph, size.logits = None, None
            log.warning("decode steps of %d rows run without a CUDA graph: %s", rows, self.failed[rows])

    @property
    def captured(self) -> list[int]:
        return sorted(rows for rows, size in self._sizes.items() if size.graph is not None)
