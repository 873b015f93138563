"""Structured output: a request's constraint as llguidance grammars, compiled once per constraint and tokenizer.

A constraint is servelab's own small JSON form (what SamplingParams.constraint stores and the queue carries):
{"schema": <a JSON Schema>} answers with JSON valid against the schema; {"schema": ..., "text": true} also lets
the answer be free text that does not open with "{" (tool_choice auto: a tool call or a text answer, the model
picks by its first token); "tools": true marks the JSON as a tool call {"name", "arguments"}. `constraint_json` writes it, `check_constraint` says what is wrong with it without a
tokenizer (the API refuses a bad schema before it is queued), `Grammars` keeps one compiled matcher per
constraint (an LRU keyed by the constraint's JSON, which keeps the schema's key order: property order is part
of the grammar) for one tokenizer, and hands each constrained row its own copy. JSON is written compact: no
whitespace between tokens, so a small model cannot pad an answer with blank lines until max_tokens.
Knows llguidance; no torch (the API checks schemas with this module): the sampler applies the masks.
"""

from __future__ import annotations

import functools
import json
import threading
import weakref
from collections import OrderedDict
from typing import Any

import llguidance
from llguidance import LLMatcher

JSON_OPTIONS = {"whitespace_flexible": False}
CACHE_SIZE = 64  # compiled constraints kept per tokenizer; a matcher is a few hundred KB at most


def constraint_json(schema: dict[str, Any] | bool, *, text: bool = False, tools: bool = False) -> str:
    """The stored form: compact JSON in the schema's own key order. tools: the JSON is a tool call (the grammar
    does not read it; the answer is rendered as OpenAI's tool_calls)."""
    spec: dict[str, Any] = {"schema": schema}
    if text:
        spec["text"] = True
    if tools:
        spec["tools"] = True
    return json.dumps(spec, separators=(",", ":"), ensure_ascii=False)


def is_tool_call(constraint: str | None) -> bool:
    """Whether a stored constraint's JSON answer is a tool call."""
    return constraint is not None and bool(json.loads(constraint).get("tools"))


def _llguidance(call, *args, **kwargs):
    """An llguidance call whose panic (pyo3's PanicException, a BaseException: the library failing on an input it
    should refuse, such as cutting an error message inside a character) becomes a ValueError naming it."""
    try:
        return call(*args, **kwargs)
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except ValueError:
        raise
    except BaseException as exc:  # noqa: BLE001 NOTE: PanicException cannot be named (pyo3 makes it at run time)
        raise ValueError(f"llguidance failed on it ({type(exc).__name__}: {str(exc)[:200]})") from None


def grammar_of(constraint: str) -> str:
    """llguidance's grammar for a stored constraint; ValueError when it is not one."""
    try:
        spec = json.loads(constraint)
    except ValueError as exc:
        raise ValueError(f"the constraint is not JSON: {exc}") from None
    if not isinstance(spec, dict) or "schema" not in spec or set(spec) - {"schema", "text", "tools"}:
        raise ValueError('a constraint is {"schema": ..., "text": true|false, "tools": true|false}')
    schema = spec["schema"]
    if not isinstance(schema, dict | bool):
        raise ValueError("the schema must be a JSON object (or true/false)")
    if not spec.get("text"):
        return _llguidance(LLMatcher.grammar_from_json_schema, schema, defaults=JSON_OPTIONS)
    # NOTE: free text that does not open with "{", or the JSON; the first token decides which, so the two never
    # overlap and a tool call is told from text by its first character
    lark = ('%llguidance {}\nstart: TEXT | answer\nTEXT: /[^{](.|\\n)*/\nanswer: %json '
            + json.dumps({**schema, "x-guidance": JSON_OPTIONS} if isinstance(schema, dict) else schema))
    return _llguidance(LLMatcher.grammar_from_lark, lark)


@functools.lru_cache(maxsize=256)
def check_constraint(constraint: str) -> str | None:
    """What is wrong with a constraint (llguidance's words: an unknown type, a $ref to nowhere, an unsatisfiable
    schema, a keyword it does not implement), or None when it compiles. Kept per constraint: a batch file's lines
    sharing a schema check it once."""
    try:
        grammar = grammar_of(constraint)
    except ValueError as exc:
        return str(exc)
    try:
        return _llguidance(LLMatcher.validate_grammar, grammar, None) or None
    except ValueError as exc:
        return str(exc)


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a transformers fast tokenizer (about 1.4 s to build for a 49k vocabulary: built on the
    first constrained request, once per tokenizer object and logits width)."""
    with _LOCK:
        per_tokenizer = _TOKENIZERS.setdefault(tokenizer, {})
        key = (vocab_size, tuple(sorted(eos_token_ids)))
        if key not in per_tokenizer:
            import llguidance.hf  # NOTE: here, not at the top: it imports transformers, which the api has not

            per_tokenizer[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                              eos_token=sorted(eos_token_ids))
        return per_tokenizer[key]


class Grammars:
    """Compiled constraints for one tokenizer: `matcher(constraint)` is a fresh matcher (a copy of the compiled
    one, which keeps its lexer's states), compiled on a constraint's first use and kept in an LRU."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], size: int = CACHE_SIZE) -> None:
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, list(eos_token_ids)
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self.size = size
        self.num_compiled = 0  # compilations so far (cache misses)

    def matcher(self, constraint: str) -> LLMatcher:
        """ValueError with llguidance's message when the constraint does not compile."""
        compiled = self._compiled.get(constraint)
        if compiled is None:
            tokenizer = ll_tokenizer(self._tokenizer, self.vocab_size, self._eos)
            compiled = _llguidance(LLMatcher, tokenizer, grammar_of(constraint), log_level=0)
            if compiled.is_error():
                raise ValueError(compiled.get_error())
            self.num_compiled += 1
            self._compiled[constraint] = compiled
            while len(self._compiled) > self.size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(constraint)
        return compiled.deep_copy()
