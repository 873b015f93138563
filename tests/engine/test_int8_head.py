"""The output layer in int8 (`lm_head_weights: int8`): servelab's int8 kernel against its exact reference on every
build this CPU runs, the tied embedding read from the same table, and the engine's greedy decoding against
transformers' forward with the same int8 head and embedding.
"""

from __future__ import annotations

import copy

import pytest
import torch

from servelab.engine.engine import Engine
from servelab.engine.kernels import ISAS, isa_reason, load_blocked_kernel
from servelab.engine.linear import Int8Linear, LinearKernelError
from servelab.request import GenerationRequest, SamplingParams
from tests.engine.conftest import make_config
from tests.engine.naive import naive_greedy
from tests.engine.test_int4_kernel import _quantized_rows

BUILDS = [pytest.param(isa.name, marks=pytest.mark.skipif(isa_reason(isa) is not None, reason=f"{isa_reason(isa)}"))
          for isa in ISAS]


def _int8_rows(weight: torch.Tensor) -> torch.Tensor:
    """The weight as the int8 layout holds it: per output row, s = max|w| / 127 and round(w / s) x s."""
    scales = weight.abs().amax(1, keepdim=True) / 127
    return torch.where(scales > 0, (weight / torch.where(scales > 0, scales, 1)).round().clamp(-127, 127), 0) * scales


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_matmul_equals_its_quantised_reference(build: str, dtype: torch.dtype, settings) -> None:
    """Exact up to fp32 summation order against x quantised per group and W per row: a wrong byte, offset or
    scale is a large error. The AVX2 build without VNNI takes |q| x signed x, which must not saturate."""
    blocked = load_blocked_kernel(settings.cache_dir, build)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(72, 128, generator=generator) * 0.1
    weight[3] = 0  # an all-zero row: scale 0, and nothing divides by it
    weight[5, 7] = 4.0  # an outlier: the row's scale follows it, q = 127 there
    head = Int8Linear(blocked, weight.to(dtype))
    assert head.out_features == 72 and head.weight.shape == (5, 32, 64)  # padded to 80 outputs
    exact = _int8_rows(weight.to(dtype).float())
    for rows in (1, 2, 3, 5, 9, 17, 40):
        x = (torch.randn(rows, 128, generator=generator) * 3).to(dtype)
        x[0, :64] = 127 / 3  # a group at full scale against the outlier row: the largest products
        got = head(x)
        assert got.dtype == dtype and got.shape == (rows, 72)
        want = _quantized_rows(x.float(), 64) @ exact.t()
        tolerance = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 0.008, "atol": 0.02}
        torch.testing.assert_close(got.float(), want, **tolerance)
        assert (got.float() - x.float() @ weight.to(dtype).float().t()).norm() <= 0.03 * (x.float() @ weight.t()).norm()
    ids = torch.tensor([[0, 5], [71, 3]])
    torch.testing.assert_close(head.rows(ids), exact[ids], rtol=0, atol=0)  # the embedding from the same table
    every = torch.arange(72)  # every row, the last quad's one block (a stride of 64) as well as the full quads'
    assert torch.equal(head.rows(every), exact) and head.rows(torch.tensor([], dtype=torch.long)).shape == (0, 128)
    with pytest.raises(RuntimeError, match="id 80 is outside the table's 80 rows"):
        head.rows(torch.tensor([80]))


def test_int8_head_bytes_are_half_of_bf16(settings) -> None:
    blocked = load_blocked_kernel(settings.cache_dir)
    if blocked.module is None:
        pytest.skip(blocked.reason)
    head = Int8Linear(blocked, torch.randn(4096, 576))
    assert sum(t.numel() * t.element_size() for t in head.tensors()) == 4096 * 576 + 4096 * 4


@torch.inference_mode()
def test_engine_with_an_int8_head_decodes_like_naive_greedy_with_that_head(tiny_folder, settings) -> None:
    if load_blocked_kernel(settings.cache_dir).module is None:
        pytest.skip("this CPU runs no servelab build")
    engine = Engine.from_config(make_config(str(tiny_folder), lm_head_weights="int8"), settings)
    head = engine.decoder.lm_head
    assert isinstance(head, Int8Linear) and engine.decoder.embed_from_head is head and engine.decoder.embed is None
    assert engine.kernel.endswith(", int8 output layer")
    reference = copy.deepcopy(engine.model)  # transformers' forward, its head and tied embedding the int8 table's
    table = head.rows(torch.arange(head.out_features))
    reference.model.embed_tokens.weight = torch.nn.Parameter(table, requires_grad=False)
    reference.lm_head = _Head(head)
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
    requests = [GenerationRequest(f"r{i}", prompt=p, params=SamplingParams(max_new_tokens=8)) for i, p in enumerate(prompts)]
    result = engine.generate(requests)
    for request, completion in zip(requests, result.completions):
        assert list(completion.token_ids) == naive_greedy(reference, engine.encode(request), 8, engine.eos_token_ids)
    plain = Engine.from_config(make_config(str(tiny_folder)), settings)
    assert engine.weight_bytes < plain.weight_bytes - 0.7 * table.numel() * 4  # the fp32 table at a quarter


class _Head(torch.nn.Module):
    def __init__(self, head: Int8Linear) -> None:
        super().__init__()
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def test_an_int8_head_that_cannot_run_is_refused_with_the_reason(tiny_folder, settings) -> None:
    with pytest.raises(LinearKernelError, match="lm_head_weights 'int8' cannot run here: it needs servelab's decoder"):
        Engine.from_config(make_config(str(tiny_folder), lm_head_weights="int8", decoder="transformers"), settings)
    with pytest.raises(ValueError, match="lm_head_weights"):
        make_config(str(tiny_folder), lm_head_weights="int4")
