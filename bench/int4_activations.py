"""servelab's int4 kernel on int8 activations against fp32 ones (awq.activations), on the bundled model's
awq-int4-fast checkpoint, one thread:

- agreement: greedy tokens of each against ATen's int4 matmul (configs/awq-int4-fast-aten.yaml, the same
  checkpoint and output layer), on the 32 chat prompts (chat template, batches of 16) and on 32 LAMBADA passages
  (seed 0, one at a time): how many of 32 are identical over the first --new-tokens tokens, and where the others
  part. --heads picks the output layer on both sides: bf16 as the checkpoint stores it (auto) and/or int8. The
  reference against itself too: its chat prompts batched against one at a time (its rounding depends on the
  batch), the agreement no other kernel can be expected to beat.
- speed: decode tok/s of the two, interleaved round by round (bench.side_by_side): B x (N - 1) / (t_N - t_1)
  with a 64-token prompt and N = 64, the ratio float / int8 per round and its median.

    python -m bench.int4_activations --batch-sizes 1,16,64 --rounds 3 --heads auto,int8

Make the checkpoint first: servelab quantize --config configs/awq-int4-fast.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bench.side_by_side import compare_decode, positive_ints
from servelab.config import ServingConfig
from servelab.engine.engine import Engine
from servelab.request import ChatMessage, GenerationRequest, SamplingParams
from servelab.settings import Settings

REPO = Path(__file__).resolve().parents[1]
ACTIVATIONS = ("int8", "float")


def _config(activations: str, head: str) -> ServingConfig:
    base = ServingConfig.from_yaml(REPO / "configs" / "awq-int4-fast.yaml")
    return base.model_copy(update={"lm_head_weights": head,
                                   "awq": base.awq.model_copy(update={"activations": activations})})


def _aten(head: str) -> ServingConfig:
    return ServingConfig.from_yaml(REPO / "configs" / "awq-int4-fast-aten.yaml").model_copy(
        update={"lm_head_weights": head})


def _greedy(engine: Engine, batches: list[list[GenerationRequest]]) -> list[list[int]]:
    out = []
    for batch in batches:
        out += [list(c.token_ids) for c in engine.generate(batch).completions]
    return out


def _prompt_sets(new_tokens: int) -> dict[str, list[list[GenerationRequest]]]:
    from servelab.lab.quality import lambada_passages

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    chat = [json.loads(line)["prompt"] for line in (REPO / "servelab/analysis/prompts/chat.jsonl").read_text().splitlines()]
    chat_requests = [GenerationRequest(f"chat-{i}", messages=(ChatMessage(role="user", content=p),), params=params)
                     for i, p in enumerate(chat[:32])]
    lambada = [[GenerationRequest(f"lambada-{p.index}", prompt=p.context, params=params)]
               for p in lambada_passages(32, seed=0)]
    return {"chat (batches of 16)": [chat_requests[:16], chat_requests[16:]], "LAMBADA (one at a time)": lambada}


def _report(what: str, reference: list[list[int]], tokens: list[list[int]], new_tokens: int) -> None:
    parts = sorted(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), new_tokens)
                   for x, y in zip(reference, tokens))
    same = sum(p == new_tokens for p in parts)
    print(f"{what}: {same} of {len(parts)} identical over {new_tokens} tokens; the others part at tokens "
          f"{[p for p in parts if p < new_tokens]}", flush=True)


def agreement(heads: list[str], new_tokens: int, settings: Settings) -> None:
    sets = _prompt_sets(new_tokens)
    chat = "chat (batches of 16)"
    for head in heads:
        aten = Engine.from_config(_aten(head), settings)
        reference = {name: _greedy(aten, batches) for name, batches in sets.items()}
        print(f"reference: {aten.kernel}", flush=True)
        alone = _greedy(aten, [[request] for batch in sets[chat] for request in batch])
        _report(f"the reference against itself, output layer {head}: chat prompts batched against one at a time",
                reference[chat], alone, new_tokens)
        del aten
        for activations in ACTIVATIONS:
            engine = Engine.from_config(_config(activations, head), settings)
            for name, batches in sets.items():
                _report(f"{name}, output layer {head}, activations {activations} ({engine.kernel})", reference[name],
                        _greedy(engine, batches), new_tokens)


def speed(batch_sizes: list[int], rounds: int, settings: Settings) -> None:
    compare_decode({a: Engine.from_config(_config(a, "int8"), settings) for a in ACTIVATIONS}, batch_sizes, rounds)


def _heads(text: str) -> list[str]:
    heads = text.split(",")
    if any(h not in ("auto", "int8") for h in heads):  # NOTE: "" splits to [""], refused here too
        raise argparse.ArgumentTypeError(f"expected a comma list of auto and int8, got {text!r}")
    return heads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.int4_activations", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=positive_ints, default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, choices=range(1, 21), default=3, metavar="1..20")
    parser.add_argument("--heads", type=_heads, default=["auto"], help="output layer on both sides: auto (bf16), int8")
    parser.add_argument("--new-tokens", type=int, choices=range(2, 257), default=32, metavar="2..256",
                        help="greedy tokens compared")
    parser.add_argument("--skip", choices=("agreement", "speed"), help="run only the other part")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    settings = Settings()  # SERVELAB_CACHE_DIR, else .cache
    if args.skip != "agreement":
        agreement(args.heads, args.new_tokens, settings)
    if args.skip != "speed":
        speed(args.batch_sizes, args.rounds, settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
