"""The bf16 CPU LoRA kernel (runtime/kernels/cpu_lora.c) against the PyTorch path (runtime/layers/lora.add_lora) on
the same bf16 inputs, and against the exact sum, on each of its paths up to the instruction set in use (AVX2,
AVX512-BF16; isa.lowered runs the AVX2 one on an AVX512-BF16 machine); its choice by the model and the fallback
where it does not serve (portable); an engine's mixed batch on both paths.

Tolerance: both paths round the shrunk product x @ Aᵀ to bf16 (from float32 sums in different orders, so a value
may round to a neighbour); the kernel then sums the delta in float32 and rounds y + delta once, the PyTorch path
rounds the delta to bf16 before the add. So the kernel is within half a bf16 unit (2^-8 relative) of y + delta
computed exactly from the bf16-rounded shrunk product, plus a shrunk value's rounding, 2^-8 of the delta's terms'
magnitude (|shrunk| @ |B|); and the two paths differ by at most one bf16 unit of the result (2^-7 relative) plus
2^-7 of those terms."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.peft_reference import make_adapter
from tests.support.reference import assert_close_in_bf16
from warmstart.runtime import LLM, SamplingParams
from warmstart.runtime.engine.engine import LLMEngine
from warmstart.runtime.engine.lora import lora_from_peft
from warmstart.runtime.engine.options import EngineOptions
from warmstart.runtime.kernels import cpu_lora, isa
from warmstart.runtime.layers import lora as torch_lora
from warmstart.runtime.layers.lora import LoraSlots, LoraStep, lora_step

NO_COMPILER = shutil.which("cc") is None and shutil.which("gcc") is None
pytestmark = pytest.mark.skipif(NO_COMPILER and cpu_lora._ext is None, reason="no C compiler here")
# the levels up to the one in use (WARMSTART_CPU_ISA=avx2 stops at avx2, as an AVX2 machine would) at which the
# kernel runs: avx2 and above
KERNEL_LEVELS = [level for level in isa.LEVELS[: isa.LEVELS.index(isa.chosen()) + 1]
                 if isa.LEVELS.index(level) >= isa.LEVELS.index("avx2")]  # fmt: skip
CPU = torch.device("cpu")


@pytest.fixture(params=KERNEL_LEVELS)
def level(request: pytest.FixtureRequest) -> Iterator[str]:
    """The kernel runs at each of its levels for the test."""
    with isa.lowered(request.param):
        assert cpu_lora.cpu_supported()
        yield request.param
# module -> (in_features, out_features of each slice): odd sizes, one wider than a 64-column block and a 16-column
# vector's multiples
SHAPES = {"qkv": (41, [48, 24, 24]), "o_proj": (48, [37]), "gate_up": (33, [72, 72]), "down": (72, [130])}
RANKS = [3, 8, 1, 16, 0]  # per slot (max_rank 16); the last slot empty
LEAVES_OUT = {2: "down", 1: "qkv"}  # slot -> a module its adapter does not adapt


def bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def filled_slots(num_layers: int = 1) -> LoraSlots:
    slots = LoraSlots.empty(len(RANKS), 16, SHAPES, num_layers, torch.bfloat16, CPU)
    for slot, rank in enumerate(RANKS):
        if rank == 0:
            continue
        layers = []
        for layer in range(num_layers):
            modules = {}
            for i, (module, (fan_in, outs)) in enumerate(SHAPES.items()):
                if LEAVES_OUT.get(slot) == module:
                    continue
                seed = 1000 * layer + 10 * slot + i
                modules[module] = (bf16(len(outs) * rank, fan_in, seed=seed), bf16(sum(outs), rank, seed=seed + 7,
                                                                                   scale=0.1))
            layers.append(modules)
        slots.fill(slot, rank, layers)
    return slots


def exact(y: torch.Tensor, x: torch.Tensor, slots: LoraSlots, row_slots: list[int], module: str
          ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Row by row in float64: (y + bf16(x @ Aᵀ) @ Bᵀ slice by slice, |bf16(x @ Aᵀ)| @ |Bᵀ|)."""
    out, terms = y.double().clone(), torch.zeros_like(y, dtype=torch.float64)
    for row, slot in enumerate(row_slots):
        if slot < 0:
            continue
        a = slots.a[0][module][slot].double()  # [in, slices, max_rank]
        b = slots.b[0][module][slot].double()  # [max_rank, out]
        column = 0
        for s, width in enumerate(SHAPES[module][1]):
            shrunk = (x[row].double() @ a[:, s]).to(torch.bfloat16).double()
            out[row, column : column + width] += shrunk @ b[:, column : column + width]
            terms[row, column : column + width] += shrunk.abs() @ b[:, column : column + width].abs()
            column += width
    return out, terms


def mixed_rows(num_rows: int, seed: int) -> list[int]:
    """Rows of every slot (the empty one too: its rank is 0), of none, in no order; at least one adapter row."""
    rng = random.Random(seed)
    row_slots = [rng.choice([-1, 0, 1, 2, 3, 4]) for _ in range(num_rows)]
    row_slots[rng.randrange(num_rows)] = 3
    return row_slots


def assert_kernel_matches(row_slots: list[int], slots: LoraSlots, module: str, seed: int) -> None:
    step = lora_step(row_slots, slots, CPU)
    assert step is not None
    fan_in, outs = SHAPES[module]
    x, y = bf16(len(row_slots), fan_in, seed=seed), bf16(len(row_slots), sum(outs), seed=seed + 1)
    ours = cpu_lora.add_lora(y.clone(), x, step, 0, module)
    reference = torch_lora.add_lora(y.clone(), x, step, 0, module)
    want, terms = exact(y, x, slots, row_slots, module)
    assert ours.dtype == torch.bfloat16
    to_reference = (ours.double() - reference.double()).abs()
    limit = reference.double().abs() * 2.0**-7 + terms * 2.0**-7 + 1e-30
    assert bool((to_reference <= limit).all()), f"worst excess over the PyTorch path {(to_reference - limit).max()}"
    to_exact = (ours.double() - want).abs()
    limit = want.abs() * 2.0**-8 + terms * (2.0**-8 + 1e-5) + 1e-30
    assert bool((to_exact <= limit).all()), f"worst excess over the exact sum {(to_exact - limit).max()}"
    untouched = [row for row, slot in enumerate(row_slots) if slot < 0 or RANKS[slot] == 0
                 or LEAVES_OUT.get(slot) == module]
    assert torch.equal(ours[untouched], y[untouched])  # rows of no adapter (or none for this module) keep y's bits


def test_the_kernel_was_built() -> None:
    assert cpu_lora._ext is not None, "the LoRA kernel is missing: reinstall (pip install -e .)"


@pytest.mark.parametrize("module", list(SHAPES))
@pytest.mark.parametrize("num_rows", [1, 2, 5, 9, 33, 130])
def test_kernel_matches_the_pytorch_path(num_rows: int, module: str, level: str) -> None:
    """Decode-sized and prefill-sized steps (one tile per slot, or several tiles of one slot), rows not sorted."""
    slots = filled_slots()
    row_slots = mixed_rows(num_rows, seed=num_rows)
    assert_kernel_matches(row_slots, slots, module, seed=num_rows)


def test_one_row_a_slot_with_fewer_rows_and_rows_of_none(level: str) -> None:
    slots = filled_slots()
    for row_slots in ([3], [-1, 0], [3, 3, 3, 3, 3, 0, -1, 3, 3], [-1, -1, -1, 1, -1]):
        for module in SHAPES:
            assert_kernel_matches(row_slots, slots, module, seed=len(row_slots))


def test_threads_split_the_work_not_the_sums(level: str) -> None:
    """Each output is summed by one thread in a fixed order: 1 and 2 threads give the same bits."""
    slots = filled_slots()
    step = lora_step(mixed_rows(40, seed=3), slots, CPU)
    assert step is not None
    x, y = bf16(40, 33, seed=4), bf16(40, 144, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_lora.add_lora(y.clone(), x, step, 0, "gate_up")
        torch.set_num_threads(2)
        two = cpu_lora.add_lora(y.clone(), x, step, 0, "gate_up")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two) and not torch.equal(one, y)


def test_strided_rows_of_x_and_a_module_no_adapter_adapts(level: str) -> None:
    slots = filled_slots()
    step = lora_step([0, 3, -1, 0], slots, CPU)
    assert step is not None
    wide = bf16(4, 100, seed=6)
    x, y = wide[:, 10:51], bf16(4, 96, seed=7)  # rows of x 100 apart
    assert torch.equal(cpu_lora.add_lora(y.clone(), x, step, 0, "qkv"),
                       cpu_lora.add_lora(y.clone(), x.contiguous(), step, 0, "qkv"))
    only_qkv_free = lora_step([1, 1], slots, CPU)  # slot 1 leaves qkv out
    assert only_qkv_free is not None and "qkv" not in only_qkv_free.modules
    one = lora_step([3], slots, CPU)
    assert one is not None
    row = bf16(41, seed=18).unsqueeze(1).t()  # [1, 41] with a row stride of 1
    y1 = bf16(1, 96, seed=19)
    assert torch.equal(cpu_lora.add_lora(y1.clone(), row, one, 0, "qkv"),
                       cpu_lora.add_lora(y1.clone(), row.contiguous(), one, 0, "qkv"))
    y2 = bf16(2, 96, seed=8)
    assert torch.equal(cpu_lora.add_lora(y2.clone(), bf16(2, 41, seed=9), only_qkv_free, 0, "qkv"), y2)


def test_tensors_the_kernel_does_not_take_go_to_the_pytorch_path(level: str) -> None:
    slots = filled_slots()
    step = lora_step([0, 3], slots, CPU)
    assert step is not None
    x = bf16(2, 48, seed=10)
    y = bf16(37, 2, seed=11).t()  # columns not contiguous
    assert not cpu_lora.takes(y, x, slots.a[0]["o_proj"], slots.b[0]["o_proj"])
    assert torch.equal(cpu_lora.add_lora(y.clone(), x, step, 0, "o_proj"),
                       torch_lora.add_lora(y.clone(), x, step, 0, "o_proj"))


def test_slots_of_a_rank_beyond_the_kernels_go_to_the_pytorch_path(level: str) -> None:
    rank = cpu_lora.MAX_RANK + 8
    slots = LoraSlots.empty(2, rank, SHAPES, 1, torch.bfloat16, CPU)
    fan_in, outs = SHAPES["o_proj"]
    slots.fill(1, rank, [{"o_proj": (bf16(rank, fan_in, seed=14), bf16(sum(outs), rank, seed=15, scale=0.1))}])
    step = lora_step([1, -1, 1], slots, CPU)
    assert step is not None
    x, y = bf16(3, fan_in, seed=16), bf16(3, sum(outs), seed=17)
    assert not cpu_lora.takes(y, x, slots.a[0]["o_proj"], slots.b[0]["o_proj"])
    assert torch.equal(cpu_lora.add_lora(y.clone(), x, step, 0, "o_proj"),
                       torch_lora.add_lora(y.clone(), x, step, 0, "o_proj"))


def test_the_kernel_refuses_bad_segments_clearly(level: str) -> None:
    slots = filled_slots()
    step = lora_step([0, 3], slots, CPU)
    assert step is not None
    bad = LoraStep(**{**step.__dict__, "tile_ends": step.tile_ends + 5})
    with pytest.raises(ValueError, match="sgmv: segment .* is outside 5 slots, 2 rows"):
        cpu_lora.add_lora(bf16(2, 37, seed=12), bf16(2, 48, seed=13), bad, 0, "o_proj")
    too_far = LoraStep(**{**step.__dict__, "rows": step.rows + 2})
    with pytest.raises(ValueError, match="sgmv: row 2 is outside the batch of 2"):
        cpu_lora.add_lora(bf16(2, 37, seed=12), bf16(2, 48, seed=13), too_far, 0, "o_proj")


def test_the_avx2_path_adds_the_avx512_bf16_paths_sums(level: str) -> None:
    """AVX2 widens to float32 and adds the same exact products pair by pair in _mm512_dpbf16_ps's order (as Intel
    describes it; measured so on AMD's Zen 4): the same bits as every other level, avx2 itself too."""
    slots = filled_slots()
    row_slots = mixed_rows(130, seed=11)
    step = lora_step(row_slots, slots, CPU)
    assert step is not None
    for module, (fan_in, outs) in SHAPES.items():
        x, y = bf16(len(row_slots), fan_in, seed=20), bf16(len(row_slots), sum(outs), seed=21)
        ours = cpu_lora.add_lora(y.clone(), x, step, 0, module)
        with isa.lowered("avx2"):
            on_avx2 = cpu_lora.add_lora(y.clone(), x, step, 0, module)
        assert torch.equal(ours, on_avx2) and not torch.equal(ours, y)


def test_at_portable_the_pytorch_path_serves(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """Below AVX2 (an ARM machine, or WARMSTART_CPU_ISA=portable) the kernel does not serve, a kernel call takes the
    PyTorch path, and sgmv itself refuses clearly."""
    slots = filled_slots()
    step = lora_step([0, 3, -1, 3], slots, CPU)
    assert step is not None
    x, y = bf16(4, 48, seed=22), bf16(4, 37, seed=23)
    with isa.lowered("portable"):
        assert not cpu_lora.cpu_supported() and not cpu_lora.lora_kernel_serves(CPU, torch.bfloat16)
        model = LLM.from_hf(tiny_model_dir("llama"), dtype="bfloat16").engine.runner.model
        assert model.add_lora is torch_lora.add_lora
        assert torch.equal(cpu_lora.add_lora(y.clone(), x, step, 0, "o_proj"),
                           torch_lora.add_lora(y.clone(), x, step, 0, "o_proj"))
        assert cpu_lora._ext is not None
        a, b = slots.a[0]["o_proj"], slots.b[0]["o_proj"]
        with pytest.raises(RuntimeError, match="sgmv: the LoRA kernel needs AVX2 .* run at 'portable'"):
            cpu_lora._ext.sgmv(
                y.data_ptr(), 37, x.data_ptr(), 48, a.data_ptr(), b.data_ptr(), step.rows.data_ptr(),
                step.tile_slots.data_ptr(), step.tile_starts.data_ptr(), step.tile_ends.data_ptr(),
                step.module_ranks["o_proj"].data_ptr(), 4, step.rows.numel(), step.num_tiles, a.shape[0], 48,
                a.shape[3], (37, 0, 0), 1,
            )  # fmt: skip
    assert cpu_lora.cpu_supported() == isa.at_least("avx2")


def test_the_model_chooses_the_kernel_where_it_serves(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    model_dir: Path = tiny_model_dir("llama")

    def chosen(dtype: str) -> object:
        return LLM.from_hf(model_dir, dtype=dtype).engine.runner.model.add_lora

    assert chosen("float32") is torch_lora.add_lora  # float32 keeps the path PEFT is compared with
    assert chosen("bfloat16") is (cpu_lora.add_lora if cpu_lora.cpu_supported() else torch_lora.add_lora)
    monkeypatch.setenv(cpu_lora.LORA_ENV, "torch")
    assert chosen("bfloat16") is torch_lora.add_lora
    monkeypatch.delenv(cpu_lora.LORA_ENV)
    assert not cpu_lora.lora_kernel_serves(CPU, torch.float32)
    assert cpu_lora.lora_kernel_serves(CPU, torch.bfloat16) == cpu_lora.cpu_supported()
    monkeypatch.setattr(cpu_lora, "cpu_supported", lambda: False)  # a CPU without AVX2
    assert not cpu_lora.lora_kernel_serves(CPU, torch.bfloat16)
    monkeypatch.undo()
    monkeypatch.setenv(cpu_lora.LORA_ENV, "torch")
    assert not cpu_lora.lora_kernel_serves(CPU, torch.bfloat16)
    monkeypatch.setenv(cpu_lora.LORA_ENV, "fast")
    with pytest.raises(ValueError, match="WARMSTART_CPU_LORA='fast' is not one of kernel, torch"):
        cpu_lora.lora_kernel_serves(CPU, torch.bfloat16)


LORAS = {
    "all8": {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"], "rank_pattern": {"down_proj": 2}},
    "qv4": {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "mlp3": {"r": 3, "lora_alpha": 6, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
}


def bf16_lora_engine(model_dir: Path, adapters: dict[str, Path]) -> LLM:
    options = EngineOptions(dtype="bfloat16", max_loras=len(adapters), max_lora_rank=8)
    engine = LLMEngine.from_hf(model_dir, options, device="cpu")
    for name, path in adapters.items():
        config = json.loads((path / "adapter_config.json").read_text())
        tensors = load_file(str(path / "adapter_model.safetensors"))
        engine.add_lora(name, lambda c=config, t=tensors, n=name: lora_from_peft(n, c, t, engine.config,
                                                                                  torch.bfloat16), config["r"])
    return LLM(engine)


def test_engine_mixed_batch_on_the_kernel_close_to_the_pytorch_path(tiny_model_dir, tmp_path: Path, level: str  # type: ignore[no-untyped-def]
                                                                    ) -> None:  # fmt: skip
    """Greedy bf16 runs of adapters mixed with base rows: the first tokens agree and the chosen tokens' logprobs
    stay within 0.1 of the PyTorch path's while the runs agree (bf16 sums in another order may part them late; on
    this tiny model with large adapters both bf16 paths are up to 0.2, 0.04 on average, from float32's)."""
    model_dir: Path = tiny_model_dir("llama")
    adapters = {name: make_adapter(model_dir, tmp_path / name, "LoraConfig", seed=i, **options)
                for i, (name, options) in enumerate(LORAS.items())}
    llm = bf16_lora_engine(model_dir, adapters)
    model = llm.engine.runner.model
    assert model.add_lora is cpu_lora.add_lora
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(4, 30))] for _ in range(8)]
    names: list[str | None] = ["all8", None, "qv4", "mlp3", "all8", "qv4", None, "all8"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    ours = llm.generate(prompts, params, adapter=names)
    model.add_lora = torch_lora.add_lora
    reference = llm.generate(prompts, params, adapter=names)
    base = llm.generate(prompts, params)
    assert_close_in_bf16(ours, reference, logprob_tol=0.1)
    assert any(a.token_ids != b.token_ids for a, b in zip(reference, base, strict=True))  # the adapters change tokens


@pytest.mark.parametrize("layout", ["tiles", "one tile a slot"])
@pytest.mark.parametrize("nan_slot_busy", [False, True])
def test_a_nan_adapter_cannot_reach_another_requests_row(layout: str, nan_slot_busy: bool) -> None:
    """Issue 40, 4: padding places (zeros) times a NaN B added NaN into rows[0], another request's row; also from an
    idle NaN adapter's slot under one tile a slot. Adapters are refused NaN at load (runtime/engine/lora.py); the
    batched add must not mix rows even so: on the PyTorch path and, where it runs, the kernel."""
    slots = filled_slots()
    slots.b[0]["o_proj"][1, 0, 0] = float("nan")
    busy = [0, 0, 2, 3, 3, 3] if layout == "tiles" else [0, 2, 3, 0, 2, 3]
    row_slots = busy + ([1] if nan_slot_busy else []) + [-1]
    step = lora_step(row_slots, slots, CPU)
    assert step is not None and step.by_slot == (layout == "one tile a slot"), step.by_slot
    fan_in, outs = SHAPES["o_proj"]
    x, y = bf16(len(row_slots), fan_in, seed=5), bf16(len(row_slots), sum(outs), seed=6)
    others = [row for row, slot in enumerate(row_slots) if slot != 1]
    paths = {"pytorch": torch_lora.add_lora}
    if cpu_lora.cpu_supported():
        paths["kernel"] = cpu_lora.add_lora
    for name, add in paths.items():
        out = add(y.clone(), x, step, 0, "o_proj")
        assert bool(torch.isfinite(out[others]).all()), (name, row_slots)
