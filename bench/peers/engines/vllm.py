"""vLLM's CPU build behind the peer protocol, under .cache/peers/venvs/vllm.

--model is the project's transformers folder itself (vLLM reads it, no conversion) and --precision
vLLM's dtype (float32, bfloat16); or --precision awq with --model servelab's own AWQ int4 checkpoint
(AutoAWQ GEMM layout), run by vLLM's CPU int4 kernel in bfloat16, as servelab's int4 path computes on a
CPU with bf16 instructions. One generate call takes every row, so vLLM's scheduler batches them
(max_num_seqs >= the largest batch). Prefix caching is off: every row shares one prompt, and a cache
hit would skip the prefill the other engines pay. The engine core runs in this process, on the
OpenMP threads VLLM_CPU_OMP_THREADS_BIND names, so vLLM uses the same cores as every other engine.
"""

from __future__ import annotations

import os

from bench.peers.protocol import AdapterArgs, Loaded, serve

KV_CACHE_GIB = 1  # 64 rows x 128 tokens of this model's fp32 KV cache is about 0.4 GiB


def load(args: AdapterArgs) -> Loaded:
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(KV_CACHE_GIB)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from vllm.inputs import TokensPrompt

    dtype = "bfloat16" if args.precision == "awq" else args.precision
    quantization = "awq" if args.precision == "awq" else None
    llm = vllm.LLM(model=args.model, dtype=dtype, quantization=quantization, seed=0,
                   max_num_seqs=max(64, args.max_batch_size), max_model_len=args.max_tokens,
                   enable_prefix_caching=False)

    def generate(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        params = vllm.SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens,
                                     ignore_eos=True, detokenize=False)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    info = {"dtype": dtype, "quantization": quantization, "kv_cache_gib": KV_CACHE_GIB}
    return Loaded(generate, vllm.__version__, info)


if __name__ == "__main__":
    serve(load)
