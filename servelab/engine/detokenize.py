"""Incremental detokenisation: a row's text grows token by token, and only text that is final is released.

Knows two rules a streamed answer must keep. A token may end inside a multi-byte UTF-8 character (byte-level
BPE splits them): its text is held until the character is complete. And text that could still be the start
of a stop string is held until the next tokens show it is not (a stop string found cuts the text before it):
so no released piece is ever taken back. Each token decodes a short window of ids (the tokens since the
last release and a few before them, for tokenizers whose pieces depend on their left neighbour), never the
whole output again. Also knows a token's own bytes (what log-probabilities name). Does not know the engine's
batch or the queue.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 sequence gives


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


def direct_decoder(tokenizer: Any) -> Decoder:
    """The fastest decoder giving what tokenizer.decode gives: a fast tokenizer's own Rust `decode` where transformers'
    only wraps it (its `decode` and `_decode` not overridden, no clean-up of spaces asked), else the tokenizer. Every
    row decodes two short windows a token, so at 64 rows transformers' wrapper (to_py_obj and its checks: 7.2 us a
    call against 1.8 us, the bundled tokenizer, Zen 3 EPYC) was most of a step's host work outside the model."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # NOTE: transformers before 5 names its fast tokenizers otherwise: decode through them
        return tokenizer
    kind = type(tokenizer)
    if (not isinstance(tokenizer, TokenizersBackend) or tokenizer.clean_up_tokenization_spaces
            or kind.decode is not TokenizersBackend.decode or kind._decode is not TokenizersBackend._decode):
        return tokenizer
    return tokenizer.backend_tokenizer


@dataclass
class Detokenizer:
    """The text of one row's generated ids, and how much of it is released (safe to show)."""

    tokenizer: Decoder
    stop: tuple[str, ...] = ()
    include_stop: bool = False  # vLLM's include_stop_str_in_output: the text ends after the stop string, not before
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded so far, complete characters only (until `finish`)
    released: int = 0  # characters of text already handed out
    stopped_at: int | None = None  # where a stop string begins, once one is found
    _prefix_offset: int = 0  # ids[_prefix_offset:_read_offset] is the context of the next decode
    _read_offset: int = 0

    def push(self, token_id: int, *, can_stop: bool = True) -> bool:
        """Add a token; -> whether a stop string now ends the text (it is cut before the stop string, or after it
        with include_stop). can_stop False (min_tokens not reached): stop strings are not looked for."""
        self.ids.append(token_id)
        context = self._decode(self.ids[self._prefix_offset:self._read_offset])
        window = self._decode(self.ids[self._prefix_offset:])
        if len(window) > len(context) and not window.endswith(REPLACEMENT):
            searched_from = self._search_start()
            self.text += window[len(context):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            if self.stop and can_stop:
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
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _search_start(self) -> int:
        """Where a stop string ending in text still to come could begin."""
        return max(0, len(self.text) - max((len(s) for s in self.stop), default=1) + 1)

    def _find_stop(self, searched_from: int) -> bool:
        # NOTE: earlier text held no stop string (the row would have ended), so a new one must end in the new
        # piece; it starts at most len(stop) - 1 characters before it.
        found = [(i, i + len(s)) for i, s in ((self.text.find(s, searched_from), s) for s in self.stop) if i >= 0]
        if found:
            start, end = min(found)
            self.stopped_at = end if self.include_stop else start
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


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for themselves, the others
    (controls, space, ...) for the characters from U+0100 up, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte-fallback tokens


class TokenBytes:
    """The exact bytes of a token id, as OpenAI's log-probabilities name them (`bytes`), cached per id.

    NOTE: byte-level BPE tokenizers (GPT-2's alphabet: the bundled SmolLM2, Llama 3, Qwen) are exact: a token
    holding half of a multi-byte character gives those bytes, where decoding it alone gives U+FFFD. Others:
    sentencepiece's <0xNN> byte tokens exactly, any other token as its decoded text in UTF-8. Added (special)
    tokens are their text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, bytes] = {}
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        state = decoder.__getstate__() if decoder is not None else b""  # its JSON; a Sequence lists its parts
        is_byte_level = b'"ByteLevel"' in (state if isinstance(state, bytes) else str(state).encode())
        self._alphabet = _byte_level_alphabet() if is_byte_level else None
        self._added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}

    def __call__(self, token_id: int) -> bytes:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._bytes(token_id)
        return found

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if self._alphabet is not None and piece is not None and all(c in self._alphabet for c in piece):
            return bytes(self._alphabet[c] for c in piece)
        if piece is not None and (byte := _BYTE_FALLBACK.fullmatch(piece)):
            return bytes([int(byte.group(1), 16)])
        return self.tokenizer.decode([token_id]).encode()
