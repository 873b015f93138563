"""CTranslate2's Generator behind the peer protocol, under .cache/peers/venvs/ct2.

--model is a converted folder (model.bin + vocabulary.json); --precision is the compute type
(float32 or int8: CTranslate2 has no int4, so the bench's int4 row runs int8 and says so; its CPU
backend refuses bfloat16 on this machine, see bench/peers/peers.py).
Batches go through one generate_batch call. It takes token strings, so ids are mapped through the
model's own vocabulary.json. Does not convert: bench/peers/convert.py does.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.peers.protocol import AdapterArgs, Loaded, serve


def load(args: AdapterArgs) -> Loaded:
    import ctranslate2

    generator = ctranslate2.Generator(args.model, device="cpu", compute_type=args.precision,
                                      intra_threads=args.threads, inter_threads=1)
    vocabulary: list[str] = json.loads((Path(args.model) / "vocabulary.json").read_text())

    def generate(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        results = generator.generate_batch(
            [[vocabulary[t] for t in ids] for ids in prompts], max_batch_size=len(prompts),
            sampling_topk=1, max_length=new_tokens, min_length=new_tokens, include_prompt_in_result=False,
        )
        return [list(r.sequences_ids[0]) for r in results]

    return Loaded(generate, ctranslate2.__version__, {"compute_type": args.precision})


if __name__ == "__main__":
    serve(load)
