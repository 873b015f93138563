"""Text as PostgreSQL keeps it: any Python text a request may carry, stored and read back without loss.

PostgreSQL's `text` and `jsonb` refuse U+0000 (NUL), which a prompt, a stop string, a custom_id or a generated
token may hold. Text with a NUL is stored escaped behind a mark, and read back exactly; all other text is stored
as it is, so rows written before this module read the same. Knows one reversible escape and the column types that
apply it; does not know which edge refuses what (lone surrogates, which are not text, are refused at the edges).
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.types import Text, TypeDecorator

# NOTE: U+FDD0 is a Unicode noncharacter, "reserved for internal use": no client means it as text. Text that holds
# a NUL, or starts with the mark, is stored as MARK + the text with MARK -> MARK MARK and NUL -> MARK "0"; anything
# else as it is. Bijective over all text; only an old row (written before the escape) that began with U+FDD0 would
# read differently, and none did: no edge had a reason to send one.
MARK = "\ufdd0"
_ESCAPED = re.compile(MARK + "(.)", re.DOTALL)


def to_column(value: str) -> str:
    """Text -> what a text or jsonb value can hold (no NUL)."""
    if "\x00" not in value and not value.startswith(MARK):
        return value
    return MARK + value.replace(MARK, MARK + MARK).replace("\x00", MARK + "0")


def from_column(value: str) -> str:
    """What to_column stored -> the text."""
    if not value.startswith(MARK):
        return value
    return _ESCAPED.sub(lambda m: "\x00" if m[1] == "0" else m[1], value[1:])


def json_to_column(value: Any) -> Any:
    """Every string of a JSON value (keys included) through to_column."""
    if isinstance(value, str):
        return to_column(value)
    if isinstance(value, dict):
        return {to_column(k): json_to_column(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_to_column(v) for v in value]
    return value


def json_from_column(value: Any) -> Any:
    if isinstance(value, str):
        return from_column(value)
    if isinstance(value, dict):
        return {from_column(k): json_from_column(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_from_column(v) for v in value]
    return value


class KeptText(TypeDecorator):
    """A `text` column that keeps any text (to_column on the way in, from_column on the way out)."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect) -> str | None:
        return None if value is None else to_column(value)

    def process_result_value(self, value: str | None, dialect) -> str | None:
        return None if value is None else from_column(value)


class KeptJSONB(TypeDecorator):
    """A `jsonb` column whose strings keep any text."""

    impl = JSONB
    cache_ok = True

    def process_bind_param(self, value: Any, dialect) -> Any:
        return json_to_column(value)

    def process_result_value(self, value: Any, dialect) -> Any:
        return json_from_column(value)
