"""servelab's own engine behind the peer protocol, in the project venv, through its public API only.

--model is a serving config (configs/<name>.yaml); its num_threads is replaced by --threads. The engine
takes prompt text, so the prompt ids are decoded once and checked to encode back to the same ids: a
prompt that does not round-trip is an error, not a silently different prompt. Also reports what the
runner's rooflines need (weight bytes, decode cost, compute dtype), since only this process loads it.
"""

from __future__ import annotations

from dataclasses import asdict
from importlib import metadata

from bench.peers.protocol import AdapterArgs, Loaded, serve


def load(args: AdapterArgs) -> Loaded:
    from servelab.config import ServingConfig
    from servelab.engine.engine import Engine
    from servelab.request import GenerationRequest, SamplingParams
    from servelab.lab.sweep import compute_dtype_name, decode_cost
    from servelab.settings import Settings

    config = ServingConfig.from_yaml(args.model)
    decoding = config.decoding.model_copy(update={
        "max_new_tokens": max(config.decoding.max_new_tokens, args.max_tokens - 1),  # a prompt needs 1+
        "max_context_tokens": max(config.decoding.max_context_tokens, args.max_tokens),
    })
    config = config.model_copy(update={"num_threads": args.threads, "decoding": decoding})
    engine = Engine.from_config(config, Settings())
    texts: dict[tuple[int, ...], str] = {}

    def prompt_text(ids: list[int]) -> str:
        key = tuple(ids)
        if key not in texts:
            text = engine.tokenizer.decode(ids)
            if engine.tokenizer.encode(text, add_special_tokens=False) != ids:
                raise ValueError("the prompt ids do not survive decode + encode; servelab takes text")
            texts[key] = text
        return texts[key]

    def generate(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        requests = [GenerationRequest(f"peer-{i}", prompt=prompt_text(ids), params=params)
                    for i, ids in enumerate(prompts)]
        result = engine.generate(requests)
        errors = [c.error for c in result.completions if c.error]
        if errors:
            raise RuntimeError(errors[0])
        return [list(c.token_ids) for c in result.completions]

    info = {"weight_bytes": engine.weight_bytes, "decode_cost": asdict(decode_cost(engine)),
            "compute_dtype": compute_dtype_name(engine), "kernel": engine.kernel, "config": config.name}
    return Loaded(generate, metadata.version("servelab"), info)


if __name__ == "__main__":
    serve(load)
