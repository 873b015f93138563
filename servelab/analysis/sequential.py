"""A comparison run until settled: looks after rounds and after steps of LAMBADA passages, intervals that stay
valid under the repeated looks, criteria frozen once settled, and when to stop (settled, or a budget spent).

Pure: knows the budget (rounds, passages, minutes), the confidence level each look's intervals get, and the
stopping rule; takes the verdicts of each look and the minutes elapsed as arguments. Does not run rounds, score
passages or read a clock: servelab/lab/compare.py takes the steps this module asks for.

NOTE: the method is alpha spending over the planned looks with the union (Bonferroni) bound. A criterion has at
most K looks (serving criteria: one per round from min_rounds to max_rounds; LAMBADA criteria: one per step of
passage_step passages up to max_passages), and each look's interval is read at level 1 - ALPHA / K. Whatever the
correlation between looks, the chance that any of a criterion's intervals misses its true value is at most the sum,
ALPHA = 5 %; a criterion settles on the wrong side of its limit only when its interval misses on that side, so it
is wrongly passed (or wrongly failed) with probability at most 2.5 %, the fixed plan's rate. Stopping early (a
time budget, or a settled decision) spends less, never more. Why not the tighter group-sequential boundaries
(Lan-DeMets, O'Brien-Fleming): they rest on a normal statistic of known variance, and 3-12 rounds give a t
statistic whose variance is estimated from those rounds, and the LAMBADA intervals are Newcombe's and a
bootstrap; the union bound holds for any interval that is valid at one look. O'Brien-Fleming's shape spends
almost nothing early, where a t interval on 2 degrees of freedom is already wide: simulated at the calibration's
spread (3-12 rounds, a x1.5 gain against a x1.2 goal), it settled in 6.7 rounds on average against 6.1 for an equal
split, with no fewer errors to show for it. The suite's calibration checks the rates (tests/lab/test_calibration.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from servelab.analysis.verdict import (LAMBADA_PASSAGES, SEQUENTIAL_INTERVAL, Criterion, Levels, Limits, Verdict,
                                       overall)

ALPHA = 0.05  # a criterion's chance, over all its looks, that one of its intervals misses the truth
ROUND_KINDS = ("latency", "gain")  # criteria that more rounds narrow
PASSAGE_CRITERIA = ("LAMBADA accuracy drop", "LAMBADA perplexity ratio")  # criteria that more passages narrow


class SequentialSpec(BaseModel):
    """A plan's `sequential:` section: how far a comparison may go before it must answer."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    min_rounds: int = Field(default=3, ge=2, le=50, description="rounds before the first look")
    max_rounds: int = Field(default=12, ge=2, le=50, description="the round budget; a look after every round")
    passage_step: int = Field(default=80, ge=1, le=LAMBADA_PASSAGES, description="LAMBADA passages added a step")
    max_passages: int = Field(default=640, ge=1, le=LAMBADA_PASSAGES, description="the passage budget")
    max_minutes: float | None = Field(default=None, gt=0, description="the time budget; null: none")

    @model_validator(mode="after")
    def _budgets_hold_a_look(self) -> SequentialSpec:
        if self.min_rounds > self.max_rounds:
            raise ValueError(f"min_rounds ({self.min_rounds}) must be at most max_rounds ({self.max_rounds})")
        if self.passage_step > self.max_passages:
            raise ValueError(f"passage_step ({self.passage_step}) must be at most max_passages ({self.max_passages})")
        return self

    @property
    def num_round_looks(self) -> int:
        return self.max_rounds - self.min_rounds + 1

    @property
    def num_passage_looks(self) -> int:
        return math.ceil(self.max_passages / self.passage_step)

    def levels(self, *, exact_passages: int = 0) -> Levels:
        return Levels(look_level(self.num_round_looks), look_level(self.num_passage_looks),
                      min(exact_passages, self.max_passages))


def look_level(num_looks: int, alpha: float = ALPHA) -> float:
    """The confidence level of each of `num_looks` looks, so that all of them together miss at most `alpha`."""
    assert num_looks >= 1, "a sequential criterion has at least one look"
    return 1 - alpha / num_looks


@dataclass(frozen=True)
class Look:
    """Where a comparison stood when it was judged: the data so far and the time taken (minutes)."""

    index: int  # 1 for the first look
    num_rounds: int
    num_passages: int
    minutes: float


@dataclass(frozen=True)
class Step:
    """What the comparison does next: a round, a step of passages (both, or one), or stop and say why."""

    take_round: bool = False
    take_passages: bool = False
    stop: str = ""


def is_settled(criterion: Criterion) -> bool:
    return criterion.outcome != "unsure"


def settle(previous: Verdict | None, current: Verdict, limits: Limits) -> Verdict:
    """The current look's verdict with every criterion an earlier look settled kept as it was then.

    NOTE: a settled criterion is frozen at the look that settled it: reading it again at later looks would be
    more looks than were paid for, and its answer could flip by chance. The decision follows from the kept
    criteria, so an accept or a reject, once reached, stays.
    """
    kept = {(c.kind, c.name): c for c in previous.criteria if is_settled(c)} if previous else {}
    criteria = tuple(kept.get((c.kind, c.name), c) for c in current.criteria)
    decision, reason = overall(list(criteria), limits, interval=SEQUENTIAL_INTERVAL)
    to_settle = tuple(f"{c.name}: {c.to_settle}" for c in criteria if c.outcome == "unsure" and c.to_settle) \
        if decision == "inconclusive" else ()
    return replace(current, criteria=criteria, decision=decision, reason=reason, to_settle=to_settle)


def next_step(verdicts: Sequence[Verdict], spec: SequentialSpec, look: Look, *, has_passages: bool) -> Step:
    """Stop when every candidate is accepted or rejected, or the time budget is spent; else a round while a serving
    criterion is unsure and rounds are left, and a step of passages while a LAMBADA criterion is unsure and
    passages are left (has_passages: the plan scores LAMBADA); stop when neither is left."""
    open_ = [v for v in verdicts if v.decision == "inconclusive"]
    if not open_:
        return Step(stop=f"settled: every candidate accepted or rejected after {_where(look)}")
    if spec.max_minutes is not None and look.minutes >= spec.max_minutes:
        return Step(stop=f"the time budget is spent ({look.minutes:.1f} of {spec.max_minutes:g} minutes) after "
                         f"{_where(look)}")
    unsure = [c for v in open_ for c in v.criteria if not is_settled(c)]
    take_round = look.num_rounds < spec.max_rounds and any(c.kind in ROUND_KINDS for c in unsure)
    take_passages = has_passages and look.num_passages < spec.max_passages and \
        any(c.name in PASSAGE_CRITERIA for c in unsure)
    if take_round or take_passages:
        return Step(take_round, take_passages)
    return Step(stop=f"the budget is spent after {_where(look)} (of {spec.max_rounds} rounds"
                     + (f", {spec.max_passages} passages" if has_passages else "") + "); still unsure: "
                     + ", ".join(sorted({c.name for c in unsure})))


def _where(look: Look) -> str:
    return f"{look.num_rounds} rounds, {look.num_passages} passages, {look.minutes:.1f} minutes (look {look.index})"


@dataclass
class SequentialRecord:
    """A sequential comparison as it goes: its looks, each candidate's verdict so far, when each criterion and each
    decision settled, and why it stopped."""

    spec: SequentialSpec
    levels: Levels
    looks: list[Look] = field(default_factory=list)
    verdicts: dict[str, Verdict] = field(default_factory=dict)  # candidate -> the verdict so far
    settled_at: dict[str, dict[str, int]] = field(default_factory=dict)  # candidate -> criterion -> look index
    decided_at: dict[str, int] = field(default_factory=dict)  # candidate -> the look its decision settled at
    # per look: candidate -> its criteria as that look judged them (settled ones as kept), for the narrowing chart;
    # a rejected candidate, no longer measured, has no entry after the look that rejected it
    history: list[dict[str, list[dict[str, Any]]]] = field(default_factory=list)
    stop: str = ""

    def add(self, look: Look, verdicts: Sequence[Verdict], limits: Limits, *, has_passages: bool) -> Step:
        """Judge one look (the candidates' verdicts on all the data so far); returns what to do next."""
        assert not self.stop, "a stopped comparison takes no more looks"
        self.looks.append(look)
        self.history.append({})
        for current in verdicts:
            assert current.candidate not in self.rejected, f"{current.candidate} was rejected: it is no longer judged"
            merged = settle(self.verdicts.get(current.candidate), current, limits)
            self.verdicts[current.candidate] = merged
            self.history[-1][current.candidate] = [
                {"kind": c.kind, "name": c.name, "limit": c.limit, "outcome": c.outcome, **c.measured.as_dict()}
                for c in merged.criteria]
            when = self.settled_at.setdefault(current.candidate, {})
            for c in merged.criteria:
                if is_settled(c):
                    when.setdefault(c.name, look.index)
            if merged.decision != "inconclusive":
                self.decided_at.setdefault(current.candidate, look.index)
        step = next_step(list(self.verdicts.values()), self.spec, look, has_passages=has_passages)
        self.stop = step.stop
        return step

    @property
    def rejected(self) -> set[str]:
        """Candidates rejected so far: a limit failed (or the gain goal out of reach) at a look; they are measured
        no more (servelab/lab/compare.py leaves them out of later rounds and passages), their verdict kept."""
        return {name for name, v in self.verdicts.items() if v.decision == "reject"}

    def settled_by(self, candidate: str) -> str:
        """What settled a candidate's decision and when, in words."""
        verdict, index = self.verdicts[candidate], self.decided_at.get(candidate)
        if index is None:
            return f"{candidate}: not settled ({self.stop})"
        look = self.looks[index - 1]
        names = [name for name, at in self.settled_at[candidate].items() if at == index]
        return f"{candidate}: {verdict.decision} after {_where(look)}; settled then: " + ", ".join(names)

    def as_dict(self) -> dict[str, Any]:
        return {"spec": self.spec.model_dump(mode="json"), "alpha": ALPHA, "levels": asdict(self.levels),
                "looks": [asdict(look) for look in self.looks], "settled_at": self.settled_at,
                "decided_at": self.decided_at, "history": self.history, "stop": self.stop,
                "settled_by": {name: self.settled_by(name) for name in self.verdicts}}
