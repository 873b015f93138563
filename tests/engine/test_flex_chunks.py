"""Prompt chunks reading the paged pool in place (flex_chunks): FlexAttention compiled as on a GPU (here by inductor's
CPU kernels) against a gather of the row's columns and SDPA; the tiles each query block reads; the choice on CUDA and
its refusals by name. The engine serving chunks through it like naive decoding is in test_paged_attention's flex
engine tests (its prompts come in chunks of 24 after cached prefixes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from servelab.engine import flex_chunks
from servelab.engine import paged_attention as paged
from servelab.engine.paged_attention import PagedAttentionError

H, H_KV, D = 4, 2, 16  # NOTE: the tiny Llama's heads


def _gathered(pool_k, pool_v, table: list[int], start: int, queries, scale: float) -> torch.Tensor:
    """The row's columns 0.. start + T - 1 gathered from its blocks, then causal SDPA from column start: (T, H x D)."""
    bs, T = pool_k.shape[1], queries.shape[0]
    columns = torch.arange(start + T)
    blocks, offsets = torch.tensor(table)[columns // bs], columns % bs
    k, v = pool_k[blocks, offsets].transpose(0, 1), pool_v[blocks, offsets].transpose(0, 1)  # (H_kv, S, D)
    visible = columns[None, :] <= torch.arange(start, start + T)[:, None]
    out = F.scaled_dot_product_attention(queries.transpose(0, 1)[None], k[None], v[None], attn_mask=visible,
                                         scale=scale, enable_gqa=True)  # (1, H, T, D)
    return out[0].transpose(0, 1).reshape(T, H * D)


@torch.inference_mode()  # NOTE: as a serving step runs (grad mode compiles another kernel)
def test_a_chunk_reads_its_rows_blocks_in_place_like_a_gather_of_its_columns() -> None:
    """A first chunk, one after a cached prefix whose blocks another row shares (a block of that row's sits between
    them in the pool), one ending mid-block, the last few tokens of a prompt (padded to 16), and two chunks of one size
    in one step, each in its own buffers; stale entries of a longer table must not leak into a shorter one. The pool of
    the engines' tests (40 blocks of 4 and the scratch block): one compiled kernel per padded size."""
    torch.manual_seed(0)
    bs, num_blocks = 4, 41
    pool_k, pool_v = torch.randn(num_blocks, bs, H_KV, D), torch.randn(num_blocks, bs, H_KV, D)
    chunks = flex_chunks.FlexChunks(num_heads=H, num_kv_heads=H_KV, head_dim=D, scale=D ** -0.5, block_size=bs,
                                    dtype=torch.float32, device=torch.device("cpu"), max_positions=96)
    long_row = [7, 30, 2, 11, 19, 5, 23, 40, 1, 33]
    shared = [7, 30, 12, 3, 9]  # NOTE: the first two blocks are long_row's (a cached prefix)
    cases = [(long_row, 0, 24), (shared, 8, 11), (long_row, 24, 13), (long_row, 37, 3)]
    for table, start, T in cases:
        queries = torch.randn(T, H, D)
        step = chunks.prepare(torch.tensor([*table, 0, 0], dtype=torch.int32), start, T, num_blocks)
        assert step.buffers.query.shape[2] == flex_chunks.padded_tokens(T)
        got = chunks.attend(step, queries, pool_k, pool_v)
        torch.testing.assert_close(got, _gathered(pool_k, pool_v, table, start, queries, D ** -0.5))
    # NOTE: two chunks of one padded size, both prepared before either is read (as a step prepares every chunk first)
    a = chunks.prepare(torch.tensor(long_row, dtype=torch.int32), 4, 9, num_blocks, slot=0)
    b = chunks.prepare(torch.tensor(shared, dtype=torch.int32), 0, 12, num_blocks, slot=1)
    assert a.buffers is not b.buffers
    qa, qb = torch.randn(9, H, D), torch.randn(12, H, D)
    for step, queries, table, start in ((a, qa, long_row, 4), (b, qb, shared, 0)):
        got = chunks.attend(step, queries, pool_k, pool_v)
        torch.testing.assert_close(got, _gathered(pool_k, pool_v, table, start, queries, D ** -0.5))


def test_each_tile_of_queries_reads_the_blocks_up_to_its_last_real_token() -> None:
    """A chunk of 200 tokens from column 40 (blocks of 16): padded to 256, two tiles of 128 queries; the first reads up
    to column 167's block, the second to the chunk's last (239's); a block the row does not hold maps past every
    column."""
    chunks = flex_chunks.FlexChunks(num_heads=H, num_kv_heads=H_KV, head_dim=D, scale=1.0, block_size=16,
                                    dtype=torch.float32, device=torch.device("cpu"), max_positions=512)
    table = torch.arange(20, 0, -1, dtype=torch.int32)
    step = chunks.prepare(table, 40, 200, 32)
    buffers = step.buffers
    assert buffers.query.shape == (1, H, 256, D) and buffers.count.tolist() == [[[167 // 16 + 1, 239 // 16 + 1]]]
    assert buffers.blocks[0, 0, 1, :15].tolist() == table[:15].tolist() and int(buffers.start) == 40
    assert buffers.column_of[20].item() == 0 and buffers.column_of[6].item() == 14 * 16
    assert buffers.column_of[0].item() == flex_chunks.FAR and buffers.column_of[21].item() == flex_chunks.FAR
    with pytest.raises(PagedAttentionError, match="a chunk reads 17 blocks, past the 12"):
        chunks.prepare(table[:12], 200, 60, 32)
    assert [flex_chunks.padded_tokens(n) for n in (1, 16, 17, 24, 128, 129)] == [16, 16, 32, 32, 128, 256]


def test_on_cuda_chunks_read_in_place_when_measured_faster_and_else_say_why() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert flex_chunks.choose("servelab", device=cpu, asked=False, measure=None) == ("servelab", "as the decode rows")
    assert flex_chunks.choose("torch", device=cuda, asked=False, measure=None)[0] == "torch"
    assert flex_chunks.choose("flex", device=cpu, asked=True, measure=None)[0] == "flex"
    name, reason = flex_chunks.choose("flex", device=cuda, asked=False,
                                      measure=lambda: {"flex": 40e-6, "torch": 95e-6})
    assert name == "flex" and "flex 40 us" in reason and "torch 95 us" in reason
    assert flex_chunks.choose("flex", device=cuda, asked=False,
                              measure=lambda: {"flex": 95e-6, "torch": 40e-6})[0] == "torch"
    assert flex_chunks.choose("flex", device=cuda, asked=True,
                              measure=lambda: {"flex": 95e-6, "torch": 40e-6})[0] == "flex"

    def no_kernel():
        raise ValueError("Q and KV block size must be divisible by BLOCK_M and BLOCK_N.\nmore")

    assert flex_chunks.choose("flex", device=cuda, asked=False, measure=no_kernel) == (
        "torch", "FlexAttention could not be compiled or run for prompt chunks: Q and KV block size must be divisible "
                 "by BLOCK_M and BLOCK_N.")
    with pytest.raises(PagedAttentionError, match="'flex' cannot serve here: prompt chunks' .*BLOCK_M"):
        flex_chunks.choose("flex", device=cuda, asked=True, measure=no_kernel)


def test_cudas_kernel_tiles_divide_a_pool_block_and_the_query_tile() -> None:
    cuda = torch.device("cuda")
    assert flex_chunks.kernel_options(torch.device("cpu"), 16, 256) == {}
    options = flex_chunks.kernel_options(cuda, 16, 256)
    assert options == {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 64, "BLOCK_N": 16}
    for block_size, tokens in ((16, 16), (48, 32), (256, 512), (32, 64)):
        options = flex_chunks.kernel_options(cuda, block_size, tokens)
        assert block_size % options["BLOCK_N"] == 0 and flex_chunks.Q_BLOCK % options["BLOCK_M"] == 0
        assert options["BLOCK_M"] <= tokens and options["BLOCK_N"] <= 64


def test_a_pool_flex_reads_on_cuda_keeps_its_key_offsets_within_32_bits() -> None:
    """Triton's flex kernels compute a key's offset in 32 bits: the pool's blocks (the scratch block included) times
    their slots times a slot's elements stay under 2**31, and one block more would not."""
    for block_size, num_kv_heads, head_dim in ((16, 8, 64), (16, 8, 128), (32, 1, 256)):
        most = paged.flex_pool_blocks(block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
        slot = num_kv_heads * head_dim
        assert most * block_size * slot < 2**31 <= (most + 1) * block_size * slot

