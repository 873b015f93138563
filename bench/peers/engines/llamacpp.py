"""llama.cpp (through llama-cpp-python's low-level API) behind the peer protocol, under
.cache/peers/venvs/llamacpp.

--model is a .gguf file (f32, bf16 or q4_0; bench/peers/convert.py makes them). Batches are real
llama.cpp batching: one llama_batch carries every row's prompt as its own sequence (its own KV stream:
kv_unified off, so a row attends over its own cells only), then each step decodes one token per
sequence in one llama_decode call. Greedy is the argmax of the returned logits. The KV cache is kept in
the weights' precision for f32 / bf16 (servelab keeps it in its compute dtype) and llama.cpp's default
f16 for q4_0. Does not use the high-level Llama class: it decodes one sequence at a time.
"""

from __future__ import annotations

from pathlib import Path

from bench.peers.protocol import AdapterArgs, Loaded, serve

KV_TYPES = {"f32": 0, "bf16": 30, "q4_0": 1}  # ggml_type: GGML_TYPE_F32, GGML_TYPE_BF16, GGML_TYPE_F16
KV_CELLS_ALIGN = 256  # llama.cpp pads a sequence's KV size to this


def cpu_flags() -> set[str]:
    """The CPU's flags as /proc/cpuinfo lists them (this venv has no servelab dependencies to ask)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def load(args: AdapterArgs) -> Loaded:
    import llama_cpp as ll
    import numpy as np

    ll.llama_backend_init()
    model_params, note = ll.llama_model_default_params(), None
    if args.precision == "q4_0" and "amx_int8" in cpu_flags():
        # NOTE: llama.cpp's AMX buffer (q4_0 weights repacked for AMX tiles, on by default where the CPU has AMX)
        # segfaults in its first llama_decode on a 2-core Xeon (llama-cpp-python 0.3.36; a 10-line script with
        # only llama.cpp in it does too; ggml-org/llama.cpp #20824 reports it in ggml_backend_amx_mul_mat); without
        # the extra buffer types it runs its AVX-512 q4_0 path
        model_params.use_extra_bufts = False
        note = "AMX repacking off (use_extra_bufts = false): llama.cpp's AMX q4_0 path segfaults on this CPU"
    model = ll.llama_model_load_from_file(args.model.encode(), model_params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {args.model}")
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    params = ll.llama_context_default_params()
    cells_per_seq = -(-args.max_tokens // KV_CELLS_ALIGN) * KV_CELLS_ALIGN
    params.n_seq_max = args.max_batch_size
    params.n_ctx = args.max_batch_size * cells_per_seq
    params.n_batch = args.max_batch_size * args.max_tokens  # a whole batched prompt in one llama_decode
    params.n_threads = params.n_threads_batch = args.threads
    params.kv_unified = False
    params.type_k = params.type_v = KV_TYPES[args.precision]
    ctx = ll.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    batch = ll.llama_batch_init(params.n_batch, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits)."""
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        batch.n_tokens = len(entries)
        status = ll.llama_decode(ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def greedy(rows: int) -> list[int]:
        logits = np.ctypeslib.as_array(ll.llama_get_logits(ctx), shape=(rows, n_vocab))
        return logits.argmax(axis=1).tolist()

    def generate(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
        decode([(t, pos, seq, pos == len(ids) - 1) for seq, ids in enumerate(prompts) for pos, t in enumerate(ids)])
        out = [[t] for t in greedy(len(prompts))]
        for step in range(1, new_tokens):
            decode([(row[-1], len(ids) + step - 1, seq, True) for seq, (ids, row) in enumerate(zip(prompts, out))])
            for row, t in zip(out, greedy(len(prompts))):
                row.append(t)
        return out

    info = {"ggml_type_kv": params.type_k, "n_ctx": params.n_ctx, "system": ll.llama_print_system_info().decode()}
    if note:
        info["note"] = note
    return Loaded(generate, ll.__version__, info)


if __name__ == "__main__":
    serve(load)
