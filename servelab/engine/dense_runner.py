"""The transformers runner: a plan executed through transformers' forward and dynamic cache, for models servelab's
decoder does not cover. Its rows sit in one left-padded cache in order of admission: the plan's decode rows take a
step together, then its newcomers are prefilled whole (one left-padded forward, apart from the running rows) and
joined. Rows the plan no longer names (finished, cancelled, preempted) leave the cache first.

No paged blocks, no chunks, no prefix cache: the plan's chunks are always whole (the scheduler plans so when it has
no pool). Does not know queues, databases or which rows run when.
"""

from __future__ import annotations

import time

import torch

from servelab.engine.decoding import Decodings
from servelab.engine.kvcache import BatchKVCache
from servelab.engine.runner import Runner
from servelab.outputs import StepOutput
from servelab.scheduler.scheduler import SchedulerOutput
from servelab.scheduler.state import ScheduledRequest


class TransformersRunner(Runner):
    def __init__(self, decoder, decodings: Decodings, *, pad_token_id: int, max_batch_size: int, **figures) -> None:
        super().__init__(decoder, decodings, **figures)
        self.pad_token_id, self.max_batch_size = pad_token_id, max_batch_size
        self._cache: BatchKVCache | None = None
        self._ids: list[str] = []  # the request id of each cache row, in order

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepOutput:
        meter = self.meter()
        meter.plan(plan)
        self._keep({r.request_id for r in plan.decode})
        assert self._ids == [r.request_id for r in plan.decode], "decode rows come in the cache's order"
        if not plan.rows:
            return StepOutput((), ())
        self.decodings.open(plan.rows, admitted=plan.admitted, started=time.perf_counter(), started_at_s=time.time())
        outs = []
        if plan.decode:
            outs.append(self._decode(list(plan.decode)))
        if plan.chunks:
            outs.append(self._prefill([r for r, _ in plan.chunks]))
        finished = tuple(c for o in outs for c in o.finished)
        self._keep(set(self._ids) - {c.request_id for c in finished})  # NOTE: a finished row's space is free at once
        return StepOutput(tuple(t for o in outs for t in o.new_tokens), finished,
                          tuple(t for o in outs for t in o.new_text))

    def _decode(self, rows: list[ScheduledRequest]) -> StepOutput:
        started = time.perf_counter()
        mask, positions = self.cache.next_inputs()
        last_ids = torch.tensor([r.token_ids[-1] for r in rows], dtype=torch.long, device=self.device)
        logits = self.decoder.forward(last_ids.view(-1, 1), mask, positions, self.cache)
        self.meter().cache(self.cache.num_tokens, self.cache.allocated_bytes)
        out = self.decodings.sample(logits, rows)
        self.meter().step((time.perf_counter() - started) * 1e3, num_sampled=len(rows), num_prefill_tokens=0,
                          num_decode_tokens=len(rows))
        return out

    def _prefill(self, rows: list[ScheduledRequest]) -> StepOutput:
        """One forward over the newcomers (every token they hold: a preempted row's generated ones too), left-padded
        to the longest, in a cache of their own, then joined to the running rows'."""
        assert all(r.num_computed_tokens == 0 for r in rows), "transformers' runner prefills whole rows"
        started = time.perf_counter()
        width = max(r.num_tokens for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # NOTE: left padding keeps every row's last token in the last column
            input_ids[i, width - r.num_tokens:] = torch.tensor(r.token_ids)
            attention_mask[i, width - r.num_tokens:] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
        prefilled = self.decoder.new_cache(len(rows), width)
        logits = self.decoder.forward(input_ids, attention_mask, position_ids, prefilled)  # (B, V)
        num_columns = max(r.num_columns for r in rows)
        self.cache.join(prefilled, attention_mask, num_columns=num_columns, max_rows=self.max_batch_size)
        del prefilled
        self._ids += [r.request_id for r in rows]
        self.meter().cache(self.cache.num_tokens, self.cache.allocated_bytes)
        out = self.decodings.sample(logits, rows)
        self.meter().step((time.perf_counter() - started) * 1e3, num_sampled=len(rows),
                          num_prefill_tokens=attention_mask.numel(), num_decode_tokens=0)
        return out

    @property
    def cache(self) -> BatchKVCache:
        if self._cache is None:
            self._cache = self.decoder.new_batch_cache()
        return self._cache

    def _keep(self, request_ids: set[str]) -> None:
        """Only these rows stay in the cache (the others' space is free at once)."""
        keep = [i for i, rid in enumerate(self._ids) if rid in request_ids]
        if len(keep) < len(self._ids):
            self.cache.keep(keep)
            self._ids = [self._ids[i] for i in keep]
