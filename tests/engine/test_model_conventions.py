"""A model served by its own conventions: every end-of-sequence id its generation config declares, its tokenizer's
chat template, an untied output layer, and a context no longer than its positions.

One tiny random Llama carries them all: an output layer of its own (tie_word_embeddings false), a generation config
listing two EOS ids (as Llama 3 lists <|eot_id|> and <|end_of_text|>), and a chat template unlike the bundled one.
The two EOS ids are picked from its own greedy text, so that one prompt's row reaches the first and another's the
second.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from servelab.engine.engine import Engine
from servelab.engine.loader import ModelLoadError, load_model
from servelab.request import ChatMessage, FinishReason, GenerationRequest, SamplingParams
from servelab.settings import Settings
from tests.engine.conftest import make_config, save_tiny_llama
from tests.engine.naive import naive_greedy

TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>>{% endif %}")
PROMPTS = ["the cat sat on the mat", "a river of seven blue houses", "quickly the house", "blue", "seven cats and"]
NUM_TOKENS = 10


@dataclass(frozen=True)
class OwnConventions:
    folder: Path
    reference: torch.nn.Module  # transformers' model, full precision: the naive reference
    greedy: dict[str, list[int]]  # prompt -> its greedy tokens, no EOS
    eos_rows: tuple[tuple[str, int, int], ...]  # (prompt, the EOS id it reaches first, at which token)


def _first_reached(greedy: dict[str, list[int]], tokenizer_eos: int) -> tuple[tuple[str, int, int], ...]:
    """Two prompts and an EOS id for each: each row reaches its own id (after a token or more) before the other's."""
    for first in PROMPTS:
        for second in PROMPTS:
            a, b = greedy[first], greedy[second]
            for i, eos_a in enumerate(a[1:], start=1):
                for j, eos_b in enumerate(b[1:], start=1):
                    if eos_a != eos_b and tokenizer_eos not in a[:i + 1] + b[:j + 1] and eos_a not in a[:i] + b[:j + 1] \
                            and eos_b not in b[:j] + a[:i + 1]:
                        return (first, eos_a, i), (second, eos_b, j)
    raise AssertionError(f"no two prompts reach two different tokens first: {greedy}")


@pytest.fixture(scope="module")
def own(tmp_path_factory, bundled_folder: str) -> OwnConventions:
    folder = save_tiny_llama(tmp_path_factory.mktemp("own-conventions"), bundled_folder, tie_word_embeddings=False)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    greedy = {p: naive_greedy(reference, tokenizer.encode(p, add_special_tokens=False), NUM_TOKENS, set())
              for p in PROMPTS}
    eos_rows = _first_reached(greedy, tokenizer.eos_token_id)
    generation = json.loads((folder / "generation_config.json").read_text())
    generation["eos_token_id"] = [eos for _, eos, _ in eos_rows]
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return OwnConventions(folder, reference, greedy, eos_rows)


@pytest.fixture(scope="module")
def own_engine(own: OwnConventions, settings: Settings) -> Engine:
    return Engine.from_config(make_config(str(own.folder)), settings)


def _greedy(prompt: str, **params) -> GenerationRequest:
    return GenerationRequest(prompt, prompt=prompt, params=SamplingParams(max_new_tokens=NUM_TOKENS, **params))


def test_every_eos_id_the_generation_config_lists_ends_a_row(own: OwnConventions, own_engine: Engine) -> None:
    listed = {eos for _, eos, _ in own.eos_rows}
    assert own_engine.eos_token_ids == listed | {own_engine.tokenizer.eos_token_id}  # and the tokenizer's
    prompts = [prompt for prompt, _, _ in own.eos_rows]
    completions = own_engine.generate([_greedy(p) for p in prompts]).completions
    for (prompt, eos, at), completion in zip(own.eos_rows, completions):
        assert list(completion.token_ids) == own.greedy[prompt][:at + 1], prompt  # ends on its own EOS id
        assert completion.token_ids[-1] == eos and completion.finish_reason == FinishReason.STOP


def test_an_untied_output_layer_decodes_like_naive_greedy(own: OwnConventions, own_engine: Engine) -> None:
    head, embedding = own.reference.get_output_embeddings().weight, own.reference.get_input_embeddings().weight
    assert head is not embedding and not torch.equal(head, embedding), "the output layer is the model's own"
    assert own_engine.decoder.name == "servelab"
    completions = own_engine.generate([_greedy(p, ignore_eos=True) for p in PROMPTS]).completions
    for prompt, completion in zip(PROMPTS, completions):
        assert list(completion.token_ids) == own.greedy[prompt], prompt


def test_messages_go_through_the_tokenizers_own_chat_template(own_engine: Engine) -> None:
    messages = (ChatMessage("system", "Be brief."), ChatMessage("user", "Hi there"))
    request = GenerationRequest("chat", messages=messages, params=SamplingParams(max_new_tokens=4))
    expected = own_engine.tokenizer.encode("<<system>> Be brief.\n<<user>> Hi there\n<<assistant>>",
                                           add_special_tokens=False)
    assert own_engine.encode(request) == expected
    assert own_engine.tokenizer.convert_tokens_to_ids("<|im_start|>") not in expected  # not the bundled ChatML
    assert own_engine.generate([request]).completions[0].finish_reason != FinishReason.ERROR


def test_messages_to_a_model_without_a_chat_template_fail_alone(own_engine: Engine) -> None:
    chat = GenerationRequest("chat", messages=(ChatMessage("user", "Hi"),), params=SamplingParams(max_new_tokens=4))
    template, own_engine.tokenizer.chat_template = own_engine.tokenizer.chat_template, None
    try:
        failed, served = own_engine.generate([chat, _greedy("blue")]).completions
    finally:
        own_engine.tokenizer.chat_template = template
    assert failed.finish_reason == FinishReason.ERROR and "has no chat template" in failed.error
    assert served.finish_reason != FinishReason.ERROR and len(served.token_ids) > 0


def test_a_context_longer_than_the_models_positions_is_refused_at_load(tiny_folder: Path, settings: Settings) -> None:
    longest = {"max_new_tokens": 64, "max_context_tokens": 2048}  # the tiny model's max_position_embeddings
    assert load_model(make_config(str(tiny_folder), decoding=longest), settings).model.config.max_position_embeddings \
        == 2048
    too_long = make_config(str(tiny_folder), decoding={**longest, "max_context_tokens": 4096})
    with pytest.raises(ModelLoadError, match=r"max_context_tokens is 4096, above the model's max_position_embeddings "
                                             r"\(2048, .*\): set decoding.max_context_tokens to 2048 or less"):
        load_model(too_long, settings)
