"""The LoRA shrink/expand kernels (runtime/kernels/lora.py) against the PyTorch path (runtime/layers/lora.py), and
that path against a plain per-row loop: rows of many adapters of different ranks mixed with rows of none, fused
modules of one to three slices, decode-sized and prefill-sized steps. Under TRITON_INTERPRET=1 without a GPU."""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.kernels_common import DEVICE, assert_close, randn  # sets TRITON_INTERPRET first

pytestmark = pytest.mark.kernels

from warmstart.runtime.kernels.lora import add_lora  # noqa: E402
from warmstart.runtime.layers.lora import LoraSlots, LoraStep, lora_step  # noqa: E402
from warmstart.runtime.layers.lora import add_lora as add_lora_reference  # noqa: E402

# module -> (in_features, out_features of each slice), odd sizes
SHAPES = {"qkv": (40, [48, 24, 24]), "o_proj": (48, [40]), "gate_up": (40, [72, 72]), "down": (72, [40])}
RANKS = [3, 8, 1, 16]  # per adapter, into slots of rank 16


def filled_slots(dtype: torch.dtype, seed: int) -> LoraSlots:
    slots = LoraSlots.empty(len(RANKS), 16, SHAPES, 1, dtype, torch.device(DEVICE))
    for slot, rank in enumerate(RANKS):
        modules = {}
        for i, (module, (fan_in, outs)) in enumerate(SHAPES.items()):
            if slot == 2 and module == "down":
                continue  # one adapter leaves a module out
            a = randn(len(outs) * rank, fan_in, dtype=dtype, seed=seed + 10 * slot + i)
            b = randn(sum(outs), rank, dtype=dtype, seed=seed + 100 + 10 * slot + i) * 0.1
            modules[module] = (a, b)
        slots.fill(slot, rank, [modules])
    return slots


def loop_reference(
    y: torch.Tensor, x: torch.Tensor, slots: LoraSlots, row_slots: list[int], module: str
) -> torch.Tensor:
    """Row by row, in float32: y + x @ A[slot]ᵀ @ B[slot]ᵀ from the slot's stacked weights, slice by slice."""
    out = y.float().clone()
    for row, slot in enumerate(row_slots):
        if slot < 0:
            continue
        a = slots.a[0][module][slot].float()  # [in, slices, max_rank]
        b = slots.b[0][module][slot].float()  # [max_rank, out]
        column = 0
        for s, width in enumerate(SHAPES[module][1]):
            out[row, column : column + width] += (x[row].float() @ a[:, s]) @ b[:, column : column + width]
            column += width
    return out.to(y.dtype)


def step_for(num_rows: int, seed: int, slots: LoraSlots) -> tuple[list[int], LoraStep]:
    rng = random.Random(seed)
    row_slots = [rng.choice([-1, 0, 1, 2, 3]) for _ in range(num_rows)]
    row_slots[0] = 1  # at least one adapter row
    step = lora_step(row_slots, slots, torch.device(DEVICE))
    assert step is not None
    return row_slots, step


@pytest.mark.parametrize("num_rows", [1, 5, 37])
@pytest.mark.parametrize("module", sorted(SHAPES))
def test_torch_path_equals_row_by_row(module: str, num_rows: int) -> None:
    slots = filled_slots(torch.float32, seed=1)
    row_slots, step = step_for(num_rows, num_rows, slots)
    fan_in, outs = SHAPES[module]
    x = randn(num_rows, fan_in, dtype=torch.float32, seed=2)
    y = randn(num_rows, sum(outs), dtype=torch.float32, seed=3)
    expected = loop_reference(y, x, slots, row_slots, module)
    assert_close(add_lora_reference(y.clone(), x, step, 0, module), expected)


def test_tiles_hold_one_adapter_each_and_stay_few() -> None:
    slots = filled_slots(torch.float32, seed=1)
    layouts = set()
    for seed in range(30):
        row_slots, step = step_for(1 + seed * 7, seed, slots)
        tile_slots, rows = step.tile_slots.tolist(), step.rows.tolist()
        for tile, (start, end) in enumerate(zip(step.tile_starts.tolist(), step.tile_ends.tolist(), strict=True)):
            assert 0 <= end - start <= step.tile_size
            assert {row_slots[r] for r in rows[start:end]} <= {tile_slots[tile]}
            positions = step.row_position[start:end].tolist()
            assert positions == list(range(tile * step.tile_size, tile * step.tile_size + end - start))
        assert sorted(rows) == [r for r, s in enumerate(row_slots) if s >= 0]
        assert step.pad_source[step.row_position].tolist() == rows
        present = {s for s in row_slots if s >= 0}
        if step.by_slot:  # every slot in order, padded to the busiest: at most twice the rows
            assert tile_slots == list(range(len(RANKS))) and step.rank == 16
            assert step.num_tiles * step.tile_size <= 2 * len(rows)
        else:
            assert step.num_tiles <= 2 * len(present) and step.num_tiles * step.tile_size <= 2 * len(rows)
            assert step.rank == max(RANKS[s] for s in present)
        layouts.add(step.by_slot)
    assert layouts == {True, False}
    assert lora_step([-1, -1], slots, torch.device(DEVICE)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_rows", [1, 6, 40])
@pytest.mark.parametrize("module", ["qkv", "down"])
def test_kernel_matches_torch_path(module: str, num_rows: int, dtype: torch.dtype) -> None:
    slots = filled_slots(dtype, seed=4)
    row_slots, step = step_for(num_rows, num_rows + 1, slots)
    fan_in, outs = SHAPES[module]
    x = randn(num_rows, fan_in, dtype=dtype, seed=5)
    y = randn(num_rows, sum(outs), dtype=dtype, seed=6)
    # In bfloat16 the PyTorch path rounds the shrunk and the expanded products, the kernel only its result (it
    # accumulates in float32): there both are held to the float32 row-by-row result of the same weights.
    exact = loop_reference(y, x, slots, row_slots, module)
    torch_path = add_lora_reference(y.clone(), x, step, 0, module)
    got = add_lora(y, x, step, 0, module)
    assert got.data_ptr() == y.data_ptr()  # in place, as the reference
    if dtype == torch.float32:
        assert_close(got, torch_path)
    else:
        assert_close(got, exact)
        assert_close(torch_path, exact, (3e-2, 2e-2))


# The engine forced onto the kernels (as tests/runtime/test_kernels_engine.py does, in a subprocess: Triton must see
# TRITON_INTERPRET before its first import) serves two adapters and the base in one batch as PEFT does.
ENGINE = """
import json, sys
import torch
from safetensors.torch import load_file
from warmstart.runtime import LLM, SamplingParams
from warmstart.runtime.engine.lora import lora_from_peft
model_dir, loras, prompts, adapters = json.loads(sys.argv[1])
llm = LLM.from_hf(model_dir, dtype="float32", block_size=8, num_kv_blocks=64, max_num_batched_tokens=16)
for name, path in loras.items():
    config = json.load(open(path + "/adapter_config.json"))
    tensors = load_file(path + "/adapter_model.safetensors")
    load = lambda n=name, c=config, t=tensors: lora_from_peft(n, c, t, llm.engine.config, torch.float32)
    llm.engine.add_lora(name, load, config["r"])
outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), adapter=adapters)
model = llm.engine.runner.model
print(json.dumps({"ops": model.ops.name, "add_lora": type(model.add_lora.__self__).__name__,
                  "outs": [o.token_ids for o in outs]}))
"""


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's run; on a GPU benchmarks/gpu_check.py runs the engine")
def test_engine_on_the_kernels_matches_peft(tiny_model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.support.peft_reference import assert_matches_peft, make_adapter
    from tests.support.reference import assert_matches_reference

    model_dir = tiny_model_dir("qwen2")
    loras = {"qv": make_adapter(model_dir, tmp_path / "qv", "LoraConfig", seed=1, r=4, lora_alpha=8,
                                target_modules=["q_proj", "v_proj"]),
             "all": make_adapter(model_dir, tmp_path / "all", "LoraConfig", seed=2, r=8, lora_alpha=16,
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"])}
    prompts = [[5, 6, 7, 8, 9], [(11 * i + 5) % 800 for i in range(20)], [3, 4], [9, 8, 7]]
    adapters = ["qv", "all", None, "all"]
    job = [str(model_dir), {n: str(p) for n, p in loras.items()}, prompts, adapters]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "WARMSTART_KERNELS": "triton", "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", ENGINE, json.dumps(job)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ops"] == "triton" and result["add_lora"] == "TritonOps"
    for prompt, adapter, out in zip(prompts, adapters, result["outs"], strict=True):
        if adapter is None:
            assert_matches_reference(model_dir, prompt, out, 4)
        else:
            assert_matches_peft(model_dir, loras[adapter], prompt, out)


@pytest.mark.parametrize("row_slots", [[0, 0, 2, 3, 3, 3, 1, -1], [0, 2, 3, 0, 2, 3, -1]],
                         ids=["tiles, NaN slot busy", "one tile a slot, NaN slot idle"])  # fmt: skip
def test_a_nan_adapter_cannot_reach_another_requests_row(row_slots: list[int]) -> None:
    """Issue 40, 4, on the Triton kernel (the CPU paths: test_cpu_lora.py)."""
    slots = filled_slots(torch.float32, seed=4)
    slots.b[0]["qkv"][1, 0, 0] = float("nan")
    step = lora_step(row_slots, slots, torch.device(DEVICE))
    assert step is not None
    fan_in, outs = SHAPES["qkv"]
    x = randn(len(row_slots), fan_in, dtype=torch.float32, seed=5)
    y = randn(len(row_slots), sum(outs), dtype=torch.float32, seed=6)
    others = [row for row, slot in enumerate(row_slots) if slot != 1]
    for path in (add_lora_reference, add_lora):
        out = path(y.clone(), x, step, 0, "qkv")
        assert bool(torch.isfinite(out[others]).all()), path.__module__
