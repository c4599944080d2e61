"""Tensor parallelism on GPUs, without one: the backend each device gets, the GPU each rank takes, the refusal
of more ranks than GPUs, and the step's tensors going where the follower's shard is. torch.cuda's answers and
torch.distributed's start are stubbed; the collectives themselves are proven over gloo by test_tensor_parallel.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from warmstart.runtime.engine import tensor_parallel
from warmstart.runtime.engine.device import DeviceError
from warmstart.runtime.engine.model_runner import StepInputs
from warmstart.runtime.engine.tensor_parallel import (
    TensorParallelError,
    TensorParallelGroup,
    backend_for,
    decode_step,
    encode_step,
    rank_device,
)
from warmstart.runtime.layers.attention import AttentionGroup, AttentionMetadata


def gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_gpus_talk_over_nccl_and_cpus_over_gloo() -> None:
    assert backend_for(torch.device("cuda", 1)) == "nccl"
    assert backend_for(torch.device("cpu")) == "gloo"


@pytest.mark.parametrize("name", ["cuda", "auto", "CUDA"])
def test_each_rank_takes_the_gpu_of_its_local_rank(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    gpus(monkeypatch, 4)
    assert [rank_device(name, r, 4) for r in range(4)] == [torch.device("cuda", r) for r in range(4)]
    assert rank_device("cpu", 3, 4) == torch.device("cpu")


def test_auto_without_a_gpu_keeps_every_rank_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(monkeypatch, 0)
    assert rank_device("auto", 1, 2) == torch.device("cpu")
    with pytest.raises(DeviceError, match="sees no CUDA device"):
        rank_device("cuda", 1, 2)


def test_more_ranks_than_gpus_is_refused_saying_how_many_there_are(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(monkeypatch, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    for rank in (0, 3):  # rank 0 refuses before it starts the group, a follower past the GPUs refuses too
        with pytest.raises(TensorParallelError, match=r"--tensor-parallel 4 .* sees 2 GPU\(s\) here \(cuda:0, cuda:1; "
                                                      r"CUDA_VISIBLE_DEVICES=0,1\); use --tensor-parallel 2 or fewer"):
            rank_device("cuda", rank, 4)


def test_a_gpu_index_is_refused_since_each_rank_takes_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(monkeypatch, 2)
    with pytest.raises(TensorParallelError, match="give device 'cuda'"):
        rank_device("cuda:1", 0, 2)


def joined(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], device: str
) -> tuple[TensorParallelGroup, dict[str, Any]]:
    """A group constructed with torch.distributed's start stubbed: what it asked for."""
    calls: dict[str, Any] = {}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))
    monkeypatch.setattr(dist, "new_group", lambda **kw: calls.setdefault("control", kw["backend"]))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("current", d))
    return TensorParallelGroup(timeout_s=5, device=device), calls


def test_a_rank_on_cuda_joins_over_nccl_on_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(monkeypatch, 2)
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    group, calls = joined(monkeypatch, env, "cuda")
    assert (group.device, group.backend) == (torch.device("cuda", 1), "nccl")
    assert calls["backend"] == "nccl" and calls["device_id"] == torch.device("cuda", 1) and calls["rank"] == 1
    assert calls["current"] == torch.device("cuda", 1)  # so that the loader's "cuda" is this rank's GPU
    assert calls["control"] == "gloo"


def test_a_rank_on_the_cpu_joins_over_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(monkeypatch, 2)
    group, calls = joined(monkeypatch, {"RANK": "0", "WORLD_SIZE": "2"}, "cpu")
    assert (group.device, group.backend, calls["backend"], calls["device_id"]) == (torch.device("cpu"), "gloo",
                                                                                   "gloo", None)
    assert "current" not in calls


def test_torchrun_hosts_count_only_their_own_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(monkeypatch, 2)  # 4 ranks over two hosts of 2 GPUs: this is the second host's second rank
    group, _ = joined(monkeypatch, {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, "auto")
    assert group.device == torch.device("cuda", 1)


def test_a_follower_s_step_lands_on_its_device() -> None:
    group = AttentionGroup(slice(0, 2), torch.tensor([[3, 4], [5, 0]]), torch.tensor([9, 4]), 0, True, 4)
    step = StepInputs(input_ids=torch.tensor([7, 8]), positions=torch.tensor([9, 4]),
                      meta=AttentionMetadata(slot_mapping=torch.tensor([17, 20]), groups=[group]),
                      logits_index=torch.tensor([0, 1]), highest_block=5, block_copies=[(1, 2)])
    meta = torch.device("meta")  # stands for the GPU: no data, but a device of its own
    got = decode_step(encode_step(step), meta)
    assert {t.device for t in (got.input_ids, got.positions, got.meta.slot_mapping, got.logits_index)} == {meta}
    assert got.meta.groups[0].block_tables.device.type == "cpu"  # the runner keeps tables on the host
    assert torch.equal(got.meta.groups[0].block_tables, group.block_tables) and got.block_copies == [(1, 2)]
    plain = decode_step(encode_step(step))
    assert torch.equal(plain.input_ids, step.input_ids) and torch.equal(plain.meta.slot_mapping, torch.tensor([17, 20]))


def test_a_shard_loaded_elsewhere_than_its_group_runs_is_refused() -> None:
    group = tensor_parallel.TensorParallelGroup.__new__(TensorParallelGroup)
    group.rank, group.world, group.device = 1, 2, torch.device("cuda", 1)
    shard = type("Shard", (), {"embed": torch.zeros(1)})()
    with pytest.raises(TensorParallelError, match="rank 1's weights are on cpu but its group runs on cuda:1"):
        tensor_parallel.rank_engine(None, shard, None, tensor_parallel.EngineOptions(), group)  # type: ignore[arg-type]
