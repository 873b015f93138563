"""onnxruntime-genai behind the peer protocol, under .cache/peers/venvs/ortgenai.

--model is a folder from its model builder (fp32 or int4 for the CPU provider). The thread count goes
into the decoder's session options through a config overlay, so the cached folder is never edited.
A batch is one Generator with batch_size rows; min_length = max_length = prompt + new tokens makes every
row decode exactly new_tokens, EOS ignored. onnxruntime-genai 0.18's Generator refuses batch_size
above 32 ("batch_size (64) must be in [1, 32]", whatever the config overlay); such a call is a cell's
error, not split into smaller batches. Does not convert: bench/peers/convert.py does.
"""

from __future__ import annotations

import json

from bench.peers.protocol import AdapterArgs, Loaded, serve


def load(args: AdapterArgs) -> Loaded:
    import numpy as np
    import onnxruntime_genai as og

    config = og.Config(args.model)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": args.threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)

    def generate(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        prompt_len = len(prompts[0])
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=prompt_len + new_tokens, min_length=prompt_len + new_tokens,
                                  batch_size=len(prompts), do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(np.asarray(prompts, dtype=np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        return [list(generator.get_sequence(i)[prompt_len:]) for i in range(len(prompts))]

    return Loaded(generate, og.__version__, {"precision": args.precision})


if __name__ == "__main__":
    serve(load)
