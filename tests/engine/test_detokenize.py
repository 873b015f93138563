"""Incremental detokenisation: released pieces add up to the whole-output decode, never split a character,
never show text a stop string later cuts; the engine hands the pieces out per step and cancels rows."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from servelab.engine.detokenize import Detokenizer, TokenBytes, direct_decoder
from servelab.engine.engine import Engine
from servelab.outputs import FinishReason
from servelab.request import GenerationRequest, SamplingParams

MULTIBYTE = "naïve café, 東京は晴れ, Grüße 🙂🚀, ελληνικά"


@pytest.fixture(scope="module")
def tokenizer(bundled_folder: str):
    return AutoTokenizer.from_pretrained(bundled_folder)


def _pieces(tokenizer, ids: list[int], stop: tuple[str, ...] = (), *, direct: bool = False
            ) -> tuple[list[str], Detokenizer]:
    detok, pieces = Detokenizer(direct_decoder(tokenizer) if direct else tokenizer, stop), []
    for i, token_id in enumerate(ids):
        stopped = detok.push(token_id)
        piece = detok.finish() if stopped or i == len(ids) - 1 else detok.release()
        pieces.append(piece)
        if stopped:
            break
    return pieces, detok


@pytest.mark.parametrize("direct", [False, True], ids=["transformers", "direct"])
@pytest.mark.parametrize("seed", range(6))
def test_pieces_add_up_to_the_whole_decode_and_hold_no_broken_character(tokenizer, seed: int, direct: bool) -> None:
    """Through transformers' decode, and through the tokenizer's own (direct_decoder: what the engine uses), against
    transformers' decode of the whole output."""
    rng = random.Random(seed)
    text = "".join(rng.choice([MULTIBYTE, " the cat sat", "\n", "  x ", "😀"]) for _ in range(12))
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids += [rng.randrange(len(tokenizer)) for _ in range(60)]  # NOTE: random tokens: byte pieces of any kind
    pieces, detok = _pieces(tokenizer, ids, direct=direct)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == detok.final_text
    for piece in pieces[:-1]:  # NOTE: the last piece is the end: an unfinished character is U+FFFD, as in a decode
        assert "\ufffd" not in piece or "\ufffd" in tokenizer.decode(ids, skip_special_tokens=True)
        piece.encode("utf-8")  # a lone surrogate would raise


def test_the_direct_decoder_is_the_tokenizers_own_only_where_transformers_adds_nothing(bundled_folder: str,
                                                                                      tokenizer) -> None:
    assert direct_decoder(tokenizer) is tokenizer.backend_tokenizer
    cleaned = AutoTokenizer.from_pretrained(bundled_folder, clean_up_tokenization_spaces=True)
    assert direct_decoder(cleaned) is cleaned  # NOTE: transformers' decode may clean spaces up: it decodes

    class Overridden(type(tokenizer)):
        def decode(self, ids, **kwargs):
            return "!" + super().decode(ids, **kwargs)

    tokenizer.__class__ = Overridden
    try:
        assert direct_decoder(tokenizer) is tokenizer
    finally:
        tokenizer.__class__ = Overridden.__bases__[0]


def test_a_multibyte_character_split_over_tokens_is_released_whole(tokenizer) -> None:
    ids = tokenizer.encode("🙂🚀東", add_special_tokens=False)
    assert len(ids) > 3, "the emoji should take several byte-level tokens"
    pieces, _ = _pieces(tokenizer, ids)
    assert [p for p in pieces if p] == [p for p in pieces if p and "\ufffd" not in p]
    assert "".join(pieces) == "🙂🚀東" and any(p == "" for p in pieces)


@pytest.mark.parametrize("stop", [("sat on",), ("t s", "xyz"), ("a",), ("mat.",)])
def test_no_piece_holds_text_that_a_stop_string_cuts(tokenizer, stop: tuple[str, ...]) -> None:
    text = "the cat sat on a mat. the cat sat on a mat."
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, detok = _pieces(tokenizer, ids, stop)
    expected = text[:min(text.find(s) for s in stop if s in text)]
    assert "".join(pieces) == expected == detok.final_text
    shown = ""
    for piece in pieces:
        shown += piece
        assert not any(s in shown for s in stop)


def test_text_that_only_looked_like_a_stop_string_is_released_later(tokenizer) -> None:
    ids = tokenizer.encode("the cat sat", add_special_tokens=False)
    pieces, _ = _pieces(tokenizer, ids, ("cat dog",))
    assert "".join(pieces) == "the cat sat"
    assert "cat" not in "".join(pieces[:2])  # held while "cat" could still begin "cat dog"


def test_the_engine_releases_each_rows_text_per_step(tiny_engine: Engine) -> None:
    requests = [GenerationRequest(f"r{i}", prompt=p, params=SamplingParams(max_new_tokens=24))
                for i, p in enumerate(["once upon", "the river ran", "naïve café"])]
    shown = {r.request_id: "" for r in requests}
    out = tiny_engine.add(requests)
    done = {c.request_id: c for c in out.finished}
    while True:
        for request_id, at, piece in out.new_text:
            assert piece, "only non-empty pieces are handed out"
            assert at == len(shown[request_id]), "each piece says where it begins"
            shown[request_id] += piece
        if not tiny_engine.num_live:
            break
        out = tiny_engine.step()
        done.update((c.request_id, c) for c in out.finished)
    assert shown == {i: c.text for i, c in done.items()}


def test_a_cancelled_row_leaves_at_once_with_the_text_shown(tiny_engine: Engine) -> None:
    keep = GenerationRequest("keep", prompt="once upon", params=SamplingParams(max_new_tokens=10))
    drop = GenerationRequest("drop", prompt="the river", params=SamplingParams(max_new_tokens=40, ignore_eos=True))
    shown = ""
    for out in (tiny_engine.add([keep, drop]), tiny_engine.step(), tiny_engine.step()):
        shown += "".join(p for i, _at, p in out.new_text if i == "drop")
    [cancelled] = tiny_engine.cancel(["drop", "not-running"])
    assert cancelled.finish_reason is FinishReason.CANCELLED and cancelled.text == shown
    assert cancelled.num_generated_tokens == 3 and tiny_engine.live_request_ids == ["keep"]
    while tiny_engine.num_live:
        tiny_engine.step()


def test_a_stop_string_completed_by_the_last_token_is_cut_at_the_end_too(tokenizer) -> None:
    """The row ends (length or EOS) on a token whose text is held for an unfinished character; the text it
    finally releases completes a stop string: the stop string is cut there as well."""
    ids = [tokenizer.encode("Hi", add_special_tokens=False)[0], *tokenizer.encode(" 東", add_special_tokens=False)[:1]]
    detok = Detokenizer(tokenizer, ("Hi ",))
    assert not detok.push(ids[0]) and detok.release() == ""  # "Hi" could begin "Hi "
    assert not detok.push(ids[1]), "the second token should end inside a character (held, not yet searched)"
    assert detok.finish() == "" and detok.final_text == ""
    assert tokenizer.decode(ids, skip_special_tokens=True).startswith("Hi ")


def test_each_tokens_bytes_are_exact_even_for_part_of_a_character(tokenizer) -> None:
    """OpenAI's logprobs `bytes`: a byte-level BPE token may hold part of a character; its own bytes join up to
    the text's UTF-8, where decoding each token alone gives U+FFFD."""
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    token_bytes = TokenBytes(tokenizer)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "the text splits some character over tokens"
    assert b"".join(token_bytes(i) for i in ids) == MULTIBYTE.encode()
    assert token_bytes(tokenizer.eos_token_id) == tokenizer.eos_token.encode(), "a special token is its text"
