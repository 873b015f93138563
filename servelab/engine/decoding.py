"""What a runner keeps per request while it decodes, keyed by request id: its sampler's generator, detokeniser,
grammar matcher, log-probabilities and token times; and the step's postprocessing: a token sampled for each row,
its stop conditions, the text it released, and the completions of the rows that ended.

The request's token ids and computed tokens are the scheduler's (ScheduledRequest); a sampled token is appended to
them here. Does not know the cache, the plan or which rows run (the scheduler decides), nor queues or databases.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from servelab.engine.detokenize import Detokenizer, TokenBytes, direct_decoder
from servelab.engine.grammar import Grammars
from servelab.engine.sampling import Allowed, make_generator, read_logprobs, sample_next
from servelab.outputs import Alternative, Completion, FinishReason, StepOutput, TokenLogprobs
from servelab.scheduler.state import ScheduledRequest


@dataclass
class Decoding:
    """One request's decoding state, from the step it first computes in to its end."""

    generator: torch.Generator | None
    detok: Detokenizer
    started: float  # perf_counter when its first step began; its times count from here
    started_at_s: float  # the same instant, Unix time
    matcher: Any = None  # structured output: its llguidance matcher, advanced with each token it takes
    logprobs: list[TokenLogprobs] | None = None  # a list when the request asked for them
    token_times_ms: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None  # why it failed mid-answer (its grammar)


class Decodings:
    """The decoding state of every request a runner has computed for and not yet seen end, by request id."""

    def __init__(self, tokenizer, *, vocab_size: int, eos_token_ids: set[int], device: torch.device,
                 argmax=None) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids, self.device = tokenizer, vocab_size, eos_token_ids, device
        self.token_bytes = TokenBytes(tokenizer)
        self._decoder = direct_decoder(tokenizer)  # what each row's Detokenizer decodes with
        self.argmax = argmax  # servelab's argmax kernel, or None for torch's
        self.grammars: Grammars | None = None  # compiled constraints, on the first constrained request
        self._by_id: dict[str, Decoding] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def matcher(self, constraint: str | None) -> Any:
        """A constrained row's own matcher (its constraint compiled once, kept in an LRU); None: free. ValueError
        when the constraint does not compile."""
        if constraint is None:
            return None
        if self.grammars is None:
            self.grammars = Grammars(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        return self.grammars.matcher(constraint)

    def open(self, rows: tuple[ScheduledRequest, ...], *, admitted: tuple[ScheduledRequest, ...] = (),
             started: float, started_at_s: float) -> None:
        """Rows this runner computes for the first time get their state, their times counting from now. A row
        admitted again keeps its own (a preempted row goes on), unless it has no token yet: then it starts afresh, so
        nothing left by an earlier request of its id is read. A prompt's later chunks keep the state its first made."""
        fresh = {id(r) for r in admitted if not r.num_generated_tokens}
        for r in rows:
            if r.request_id not in self._by_id or id(r) in fresh:
                params = r.request.params
                self._by_id[r.request_id] = Decoding(
                    make_generator(params, self.device),
                    Detokenizer(self._decoder, params.stop, include_stop=params.include_stop_str_in_output,
                                skip_special_tokens=params.skip_special_tokens),
                    started, started_at_s, matcher=self.matcher(params.constraint),
                    logprobs=[] if params.logprobs is not None else None)

    def close(self, request_ids) -> None:
        for request_id in request_ids:
            self._by_id.pop(request_id, None)

    # --- a step's postprocessing ---

    def sample(self, logits: torch.Tensor, rows: list[ScheduledRequest]) -> StepOutput:
        """A token for each of these rows (logits row i is rows[i]'s), appended to its tokens; the text each
        released, and the completions of the rows that finished (their state is closed)."""
        # NOTE: fp32 holds bf16 logits exactly; torch's argmax over bf16 is 5x slower than over fp32 on CPU
        logits = logits.float()
        states = [self._by_id[r.request_id] for r in rows]
        next_ids = sample_next(logits, [r.request.params for r in rows], [s.generator for s in states],
                               [r.generated_token_ids for r in rows], [r.request.prompt_token_ids for r in rows],
                               [self._suppressed(r) for r in rows], _allowed(states, logits.shape[-1]),
                               argmax=self.argmax)
        return self.postprocess(rows, states, next_ids.tolist(), self._read_logprobs(logits, next_ids, rows))

    def postprocess(self, rows: list[ScheduledRequest], states: list[Decoding], next_ids: list[int],
                    read: dict[int, tuple[float, list[tuple[int, float]]]]) -> StepOutput:
        """Each row's sampled token taken (its log-probabilities recorded where `read` has them, its stop conditions
        checked, its text released) -> the step's output; finished rows' state is closed."""
        now = time.perf_counter()
        tokens, texts, finished = [], [], []
        for j, (row, state, token_id) in enumerate(zip(rows, states, next_ids)):
            tokens.append((row.request_id, token_id))
            if j in read:  # NOTE: before the token's text joins the row's: its offset is the text so far
                state.logprobs.append(self._token_logprobs(token_id, len(state.detok.text), *read[j]))
            going_on = self._append_token(row, state, token_id, (now - state.started) * 1e3)
            at = state.detok.released
            piece = state.detok.release() if going_on else state.detok.finish()
            if piece:
                texts.append((row.request_id, at, piece))
            if not going_on:
                finished.append(self.complete(row))
        return StepOutput(tuple(tokens), tuple(finished), tuple(texts))

    def cancel(self, rows: list[ScheduledRequest]) -> list[Completion]:
        """Rows taken out for good (their client left) -> their completions, finish reason `cancelled`, holding the
        text released so far (what a streaming client was shown)."""
        self.open(tuple(rows), started=time.perf_counter(), started_at_s=time.time())  # NOTE: one never computed
        out = []
        for r in rows:
            state = self._by_id[r.request_id]
            state.finish_reason = FinishReason.CANCELLED
            out.append(self.complete(r, text=state.detok.text[:state.detok.released]))
        return out

    def complete(self, row: ScheduledRequest, *, text: str | None = None) -> Completion:
        state = self._by_id.pop(row.request_id)
        return Completion(
            request_id=row.request_id,
            text=state.detok.final_text if text is None else text,
            token_ids=tuple(row.generated_token_ids),
            num_prompt_tokens=row.num_prompt_tokens,
            finish_reason=state.finish_reason,
            seed=row.request.params.seed,
            ttft_ms=state.token_times_ms[0] if state.token_times_ms else None,
            token_times_ms=tuple(state.token_times_ms),
            e2e_ms=state.token_times_ms[-1] if state.token_times_ms else None,
            started_at_s=state.started_at_s,
            logprobs=None if state.logprobs is None else tuple(state.logprobs),
            num_cached_tokens=row.num_cached_tokens,
            error=state.error,
        )

    def _append_token(self, row: ScheduledRequest, state: Decoding, token_id: int, now_ms: float) -> bool:
        """Record a token; returns whether the row goes on decoding. As vLLM: nothing but max_new_tokens ends a row
        before min_tokens; a stop token (EOS unless ignore_eos, stop_token_ids) ends it, its text left out unless
        include_stop_str_in_output."""
        params = row.request.params
        row.token_ids.append(token_id)
        state.token_times_ms.append(now_ms)
        num_generated = row.num_generated_tokens
        can_stop = num_generated >= params.min_tokens
        is_stop_token = can_stop and ((token_id in self.eos_token_ids and not params.ignore_eos)
                                      or token_id in params.stop_token_ids)
        # NOTE: a constrained row's grammar takes its token; a complete grammar (the JSON closed) ends the row
        grammar_done = False
        if state.matcher is not None and not is_stop_token:
            if not state.matcher.consume_token(token_id):  # NOTE: the mask allowed it; a grammar's failure is reported
                state.finish_reason, state.error = FinishReason.ERROR, f"structured output: {state.matcher.get_error()}"
                return False
            grammar_done = state.matcher.is_stopped()
        hit_stop_string = (state.detok.push(token_id, can_stop=can_stop)
                           if not is_stop_token or params.include_stop_str_in_output else False)
        if is_stop_token or hit_stop_string or grammar_done:
            state.finish_reason = FinishReason.STOP
        elif num_generated >= params.max_new_tokens:
            state.finish_reason = FinishReason.LENGTH
        return state.finish_reason is None

    def _suppressed(self, row: ScheduledRequest) -> tuple[int, ...]:
        """The tokens a row may not pick at its next step: before min_tokens, its stop tokens (vLLM's min_tokens)."""
        params = row.request.params
        if row.num_generated_tokens >= params.min_tokens:
            return ()
        eos = () if params.ignore_eos else tuple(self.eos_token_ids)
        return (*eos, *params.stop_token_ids)

    def _read_logprobs(self, logits: torch.Tensor, next_ids: torch.Tensor, rows: list[ScheduledRequest]
                       ) -> dict[int, tuple[float, list[tuple[int, float]]]]:
        """{index in rows: (chosen token's log-probability, [(token, log-probability)] most likely first)} for
        the rows that asked; nothing is computed when none did."""
        asked = [j for j, r in enumerate(rows) if r.request.params.logprobs is not None]
        if not asked:
            return {}
        num_top = [rows[j].request.params.logprobs for j in asked]
        return dict(zip(asked, read_logprobs(logits, next_ids, asked, num_top)))

    def _token_logprobs(self, token_id: int, text_offset: int, logprob: float, top: list[tuple[int, float]]
                        ) -> TokenLogprobs:
        return TokenLogprobs(Alternative(token_id, self.token_bytes(token_id), logprob), text_offset,
                             tuple(Alternative(i, self.token_bytes(i), lp) for i, lp in top))


def _allowed(states: list[Decoding], vocab_size: int) -> Allowed | None:
    """The tokens each constrained row's grammar allows next (llguidance's bitmask); None when no row is."""
    constrained = [j for j, s in enumerate(states) if s.matcher is not None]
    if not constrained:
        return None
    bitmask = torch.zeros((len(constrained), (vocab_size + 31) // 32), dtype=torch.int32)
    for k, j in enumerate(constrained):
        matcher = states[j].matcher
        matcher.unsafe_compute_mask_ptr(bitmask[k].data_ptr(), bitmask.shape[1] * 4)
        if matcher.is_error() or not bitmask[k].any():
            # NOTE: a grammar that failed (a lexer past llguidance's limits) allows nothing: the row picks freely,
            # its matcher refuses the token, and the row alone ends with the grammar's error (never a NaN draw)
            bitmask[k] = -1
    return Allowed(constrained, bitmask)
