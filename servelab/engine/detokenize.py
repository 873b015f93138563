"""Incremental detokenisation: a row's text grows token by token, and only text that is final is released.

Knows two rules a streamed answer must keep. A token may end inside a multi-byte UTF-8 character (byte-level
BPE splits them): its text is held until the character is complete. And text that could still be the start
of a stop string is held until the next tokens show it is not (a stop string found cuts the text before it):
so no released piece is ever taken back. Each token decodes a short window of ids (the tokens since the
last release and a few before them, for tokenizers whose pieces depend on their left neighbour), never the
whole output again. Does not know the engine's batch or the queue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 sequence gives


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class Detokenizer:
    """The text of one row's generated ids, and how much of it is released (safe to show)."""

    tokenizer: Decoder
    stop: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded so far, complete characters only (until `finish`)
    released: int = 0  # characters of text already handed out
    stopped_at: int | None = None  # where a stop string begins, once one is found
    _prefix_offset: int = 0  # ids[_prefix_offset:_read_offset] is the context of the next decode
    _read_offset: int = 0

    def push(self, token_id: int) -> bool:
        """Add a token; -> whether a stop string now ends the text (it is cut before the stop string)."""
        self.ids.append(token_id)
        context = self._decode(self.ids[self._prefix_offset:self._read_offset])
        window = self._decode(self.ids[self._prefix_offset:])
        if len(window) > len(context) and not window.endswith(REPLACEMENT):
            searched_from = self._search_start()
            self.text += window[len(context):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            if self.stop:
                return self._find_stop(searched_from)
        return False

    def release(self) -> str:
        """The text that is final since the last call: complete characters, no possible stop-string start."""
        end = self.stopped_at if self.stopped_at is not None else len(self.text) - self._held_for_stop()
        piece = self.text[self.released:end] if end > self.released else ""
        self.released = max(self.released, end)
        return piece

    def finish(self) -> str:
        """The row has ended: whatever is left becomes final (an incomplete character decodes as U+FFFD, as a
        whole-output decode would give it); -> the last piece."""
        if self.stopped_at is None:
            context = self._decode(self.ids[self._prefix_offset:self._read_offset])
            window = self._decode(self.ids[self._prefix_offset:])
            searched_from = self._search_start()
            if len(window) > len(context):
                self.text += window[len(context):]
            self._prefix_offset = self._read_offset = len(self.ids)
            if not (self.stop and self._find_stop(searched_from)):  # NOTE: the last piece may complete a stop string
                self.stopped_at = len(self.text)
        return self.release()

    @property
    def final_text(self) -> str:
        return self.text if self.stopped_at is None else self.text[:self.stopped_at]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _search_start(self) -> int:
        """Where a stop string ending in text still to come could begin."""
        return max(0, len(self.text) - max((len(s) for s in self.stop), default=1) + 1)

    def _find_stop(self, searched_from: int) -> bool:
        # NOTE: earlier text held no stop string (the row would have ended), so a new one must end in the new
        # piece; it starts at most len(stop) - 1 characters before it.
        found = [i for i in (self.text.find(s, searched_from) for s in self.stop) if i >= 0]
        if found:
            self.stopped_at = min(found)
        return bool(found)

    def _held_for_stop(self) -> int:
        """Characters at the end of the text that begin some stop string (and so may not be shown yet)."""
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held
