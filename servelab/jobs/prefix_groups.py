"""The order a batch job's lines go out in: lines that share a prompt prefix go out together.

Knows the grouping key (a line's system message where its conversation opens with one, else the first
PREFIX_KEY_CHARS characters of its prompt or first message) and a stable grouping: groups in the order of their
first line, lines in file order within a group, so a job with one prefix (or none shared) keeps file order.
Pure: no store, no queue, no clock. servelab/jobs/ingest.py groups each slice it reads before the slice's lines
are enqueued; it cannot group across slices (see the NOTE on grouped_by_prefix).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

# NOTE: about 60 tokens, four 16-token KV blocks: plain prompts that agree this far share cached blocks worth
# keeping together; ones that part earlier share little a prefix cache could reuse
PREFIX_KEY_CHARS = 256
T = TypeVar("T")


def prefix_key(prompt: str | None, messages: Sequence[Mapping[str, Any]] | None) -> tuple[str, str]:
    """What lines that share a cached prefix have in common: the whole system message that opens a conversation
    (as llm-d's batch gateway orders by system prompt), else the leading characters of the text read first."""
    if messages:
        first = messages[0]
        content = first.get("content")
        text = content if isinstance(content, str) else ""
        if first.get("role") == "system":
            return "system", text
        return "text", text[:PREFIX_KEY_CHARS]
    return "text", (prompt or "")[:PREFIX_KEY_CHARS]


def grouped_by_prefix(items: Iterable[T], key: Callable[[T], object]) -> list[T]:
    """The items with equal keys side by side: groups in the order their first item came, items in their own order.

    NOTE: why it pays: a worker takes a bulk stream's lines in order, and its prefix cache keeps the KV blocks of
    recent prompts; lines of one system prompt in a row find it cached, while lines of several interleaved evict
    each other's blocks once the cache holds fewer prefixes than the job has. Only the order within one slice
    changes: the same lines go out, each once (the rows and the file offset commit together before anything is
    enqueued), and the fair share still counts a slice's lines, not which ones go first. Grouping a whole file
    would need its lines read ahead of the committed offset, which is what makes a resumed slice exact.
    """
    groups: dict[object, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return [item for group in groups.values() for item in group]
