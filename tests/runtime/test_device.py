"""Where the engine runs: device names resolved once and refused clearly when the
device is not there; the KV pool on CUDA sized from the GPU's memory after the weights (torch.cuda's memory
functions stubbed: no GPU here), with --gpu-memory-utilization as vLLM has it and a clear error for a pool too
small for one full-length sequence; weights moved to a device keep the layout the Triton matmuls read."""

from __future__ import annotations

import dataclasses
import inspect
import math
import pathlib
from collections.abc import Callable

import pytest
import torch

from warmstart.runtime import LLM, SamplingParams
from warmstart.runtime.engine.device import GIB, DeviceError, resolve_device
from warmstart.runtime.engine.kv_sizing import activation_reserve, kv_block_bytes, kv_blocks_for_memory
from warmstart.runtime.engine.options import EngineOptions
from warmstart.runtime.models.config import ModelConfig
from warmstart.runtime.models.weights import load_weights, weights_to
from warmstart.runtime.quant.formats import INT4_LAYOUTS, Int4Weight, Int8Weight, from_tensors

ModelDir = Callable[[str], pathlib.Path]
CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch as it is on a machine with one GPU, as far as resolve_device asks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def gpu_memory(monkeypatch: pytest.MonkeyPatch, *, total: int, free: int, held: int) -> None:
    """Stub what the pool sizing reads of a GPU: its free and total memory, and what this process holds."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: held)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


# -- device names ----------------------------------------------------------------------------------------------


def test_cpu_and_auto_without_cuda_resolve_to_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


def test_cuda_without_cuda_is_refused_saying_what_to_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("cuda", "cuda:3"):
        with pytest.raises(DeviceError, match=rf"device '{name}' was asked for, but torch .* sees no CUDA device.*"
                                              r"use device 'cpu'"):
            resolve_device(name)


@pytest.mark.usefixtures("one_gpu")
def test_auto_and_cuda_take_the_current_gpu_and_an_index_past_the_count_is_refused() -> None:
    assert resolve_device("auto") == CUDA0
    assert resolve_device("cuda") == CUDA0
    assert resolve_device("CUDA:0") == CUDA0
    with pytest.raises(DeviceError, match=r"'cuda:3' was asked for, but torch sees 1 CUDA device\(s\) here \(cuda:0\)"):
        resolve_device("cuda:3")


@pytest.mark.parametrize("name", ["gpu", "cpu:1", "mps", "cuda:", "cuda:-1", "", "auto:0"])
def test_unknown_device_names_are_refused(name: str) -> None:
    with pytest.raises(DeviceError, match="use auto, cpu, cuda or cuda:N"):
        resolve_device(name)


# -- the faces take a device ---------------------------------------------------------------------------------


def test_from_hf_takes_a_device_and_a_memory_share(tiny_model_dir: ModelDir) -> None:
    assert inspect.signature(LLM.from_hf).parameters["device"].default == "auto"
    default = LLM.from_hf(tiny_model_dir("llama"), dtype="float32", num_kv_blocks=8, device="cpu")
    half = LLM.from_hf(tiny_model_dir("llama"), dtype="float32", num_kv_blocks=8, gpu_memory_utilization=0.5)
    assert (default.engine.options.gpu_memory_utilization, half.engine.options.gpu_memory_utilization) == (0.9, 0.5)


def test_from_hf_on_the_cpu_generates_what_it_did_without_a_device(tiny_model_dir: ModelDir) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], list(range(3, 40))]
    options = {"dtype": "float32", "num_kv_blocks": 32, "max_model_len": 128}
    default = LLM.from_hf(tiny_model_dir("llama"), **options)
    on_cpu = LLM.from_hf(tiny_model_dir("llama"), device="cpu", **options)
    assert on_cpu.engine.summary()["device"] == "cpu" and on_cpu.engine.summary()["ops"] == "torch"
    assert [o.token_ids for o in on_cpu.generate(prompts, params)] == [
        o.token_ids for o in default.generate(prompts, params)
    ]


def test_from_hf_on_a_missing_gpu_fails_before_reading_the_checkpoint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="sees no CUDA device"):
        LLM.from_hf(tmp_path / "no-model-here", device="cuda")  # the device is checked first


# -- the KV pool on CUDA ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def config(tiny_model_dir: ModelDir) -> ModelConfig:
    return ModelConfig.from_dir(tiny_model_dir("llama"))


def test_pool_takes_what_the_utilization_leaves_after_weights_and_reserve(
    config: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = EngineOptions(dtype="bfloat16", max_num_seqs=1_000_000, gpu_memory_utilization=0.5)
    total, held = 16 * GIB, 3 * GIB
    gpu_memory(monkeypatch, total=total, free=total - held, held=held)
    block = kv_block_bytes(config, options)
    allowed = total // 2 - held - activation_reserve(config, options)
    blocks = kv_blocks_for_memory(config, options, 512, device=CUDA0)
    assert blocks * block <= allowed < (blocks + 1) * block
    more = kv_blocks_for_memory(config, EngineOptions(dtype="bfloat16", max_num_seqs=1_000_000), 512, device=CUDA0)
    assert more * block <= total * 0.9 - held - activation_reserve(config, options) < (more + 1) * block


def test_pool_never_takes_memory_other_processes_hold(config: ModelConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    options = EngineOptions(dtype="bfloat16", max_num_seqs=1_000_000)
    total, held, others = 16 * GIB, 1 * GIB, 12 * GIB
    gpu_memory(monkeypatch, total=total, free=total - held - others, held=held)
    blocks = kv_blocks_for_memory(config, options, 512, device=CUDA0)
    room = total - held - others - activation_reserve(config, options)
    assert blocks * kv_block_bytes(config, options) <= room < (blocks + 1) * kv_block_bytes(config, options)


def test_pool_is_capped_at_what_max_num_seqs_sequences_can_use(
    config: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu_memory(monkeypatch, total=80 * GIB, free=79 * GIB, held=GIB)
    options = EngineOptions(dtype="bfloat16", max_num_seqs=4)
    assert kv_blocks_for_memory(config, options, 512, pinned_blocks=7, device=CUDA0) == 4 * 32 + 7


def test_activation_reserve_grows_with_the_step_and_the_vocabulary(config: ModelConfig) -> None:
    small = activation_reserve(config, EngineOptions(max_num_batched_tokens=256))
    assert activation_reserve(config, EngineOptions(max_num_batched_tokens=4096)) > small
    wider = dataclasses.replace(config, vocab_size=config.vocab_size * 100)
    assert activation_reserve(wider, EngineOptions(max_num_batched_tokens=256)) > small


def test_pool_too_small_for_one_sequence_is_a_clear_startup_error(
    config: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = EngineOptions(dtype="bfloat16", gpu_memory_utilization=0.3)
    block = kv_block_bytes(config, options)
    reserve = activation_reserve(config, options)
    total = 4 * GIB
    held = int(total * 0.3) - reserve - 40 * block  # room for 40 blocks of 16 tokens: 640 tokens
    gpu_memory(monkeypatch, total=total, free=total - held, held=held)
    assert kv_blocks_for_memory(config, options, 512, device=CUDA0) == 40  # a 512-token sequence takes 32
    with pytest.raises(ValueError, match=r"the KV pool would get 40 blocks of 16 tokens .* on cuda:0: "
                                         r"gpu_memory_utilization 0\.3 of 4\.00 GiB .* one 1024-token sequence needs "
                                         r"64 blocks beside the 10 that snapshot prefixes and adapters pin: raise "
                                         r"gpu_memory_utilization \(serve --gpu-memory-utilization\), lower "
                                         r"max_model_len \(serve --max-model-len\) to at most 480, or free GPU memory"):
        kv_blocks_for_memory(config, options, 1024, pinned_blocks=10, device=CUDA0)
    # The length it names does fit.
    kv_blocks_for_memory(config, options, 480, pinned_blocks=10, device=CUDA0)
    gpu_memory(monkeypatch, total=total, free=total, held=int(total * 0.3))  # the weights take it all
    with pytest.raises(ValueError, match=r"would get 0 blocks .*gpu-memory-utilization\), or free GPU memory"):
        kv_blocks_for_memory(config, options, 512, device=CUDA0)


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01, math.nan])
def test_gpu_memory_utilization_outside_0_to_1_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        EngineOptions(gpu_memory_utilization=value).validate()


def test_the_cpu_pool_is_sized_as_before(config: ModelConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU device never asks torch.cuda anything."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: pytest.fail("asked the GPU"))
    options = EngineOptions(dtype="float32", max_num_seqs=2)
    assert kv_blocks_for_memory(config, options, 512, device=torch.device("cpu")) == 2 * 32


# -- weights on a device ---------------------------------------------------------------------------------------


def test_weights_moved_to_a_device_keep_their_int4_layout_and_int8_parts() -> None:
    """On the device the Triton matmul reads int4 in whichever layout it was stored; the CPU's kernel needs its
    own, so a CPU load repacks. ("meta" stands in for a GPU: tensors move there without one.)"""
    w = torch.randn(80, 64)
    quantized = Int4Weight.quantize(w, 32)
    for stored_layout in INT4_LAYOUTS:  # the local one, and layouts packed on other kinds of CPU
        on_device = from_tensors({**quantized.meta(), "layout": stored_layout},
                                 {k: t.to("meta") for k, t in quantized.tensors().items()})
        assert isinstance(on_device, Int4Weight) and on_device.layout == stored_layout and on_device.packed.is_meta
    int8 = Int8Weight.quantize(w)
    moved = from_tensors(int8.meta(), {k: t.to("meta") for k, t in int8.tensors().items()})
    assert isinstance(moved, Int8Weight) and moved.qweight.is_meta and moved.qweight.shape == int8.qweight.shape


def test_weights_to_moves_every_tensor_and_keeps_the_tied_head(tiny_model_dir: ModelDir) -> None:
    config = ModelConfig.from_dir(tiny_model_dir("llama3"))  # tied embeddings
    weights = load_weights(tiny_model_dir("llama3"), config, torch.float32)
    assert weights_to(weights, torch.device("cpu")) is weights
    moved = weights_to(weights, torch.device("meta"))
    assert moved.lm_head is moved.embed and moved.embed.is_meta and moved.norm.is_meta
    for layer in moved.layers:
        assert all(t is None or t.is_meta for t in vars(layer).values())


def test_every_step_runs_with_the_models_gpu_current(tiny_model_dir: ModelDir, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton launches on the thread's current CUDA device, not its tensors': a model on cuda:N makes cuda:N current
    around each forward pass (here a CPU model stands in, told it is on cuda:3), and a CPU model asks for none."""
    entered: list[torch.device] = []

    class CurrentDevice:
        def __init__(self, device: torch.device) -> None:
            entered.append(device)

        def __enter__(self) -> None: ...

        def __exit__(self, *exc: object) -> None: ...

    monkeypatch.setattr(torch.cuda, "device", CurrentDevice)
    llm = LLM.from_hf(tiny_model_dir("llama"), device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=64)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    on_cpu = llm.generate([[5, 6, 7]], params)[0].token_ids
    assert entered == []
    llm.engine.runner.model.device = torch.device("cuda", 3)
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == on_cpu
    assert entered == [torch.device("cuda", 3)] * 3  # one prefill step, two decode steps
