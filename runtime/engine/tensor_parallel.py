"""Megatron-style tensor parallelism over torch.distributed: each rank holds 1/N of every layer.

Per decoder layer, QKV is split by columns along heads (each rank gets num_heads / N query heads and
num_kv_heads / N KV heads, so its KV pool holds only its own heads) and gate/up by columns (each rank's
gate rows with the matching up rows); o_proj and down are split by rows, and their partial outputs are summed
by one all-reduce each. Embeddings, norms and the LM head are stored whole on every rank (the all-reduced
hidden states are the same everywhere). The head's work is split by vocabulary: each rank multiplies by its
slice of the head's rows and rank 0 gathers the slices. That one gather of [rows, vocab / N] logits costs less
than the head's matmul it halves (benchmarks/tensor_parallel.py measures both ways); a vocabulary that does not
divide by N falls back to rank 0 computing the whole head. The embedding lookup stays local: splitting it too
would add an all-reduce a step to save only memory and bytes pulled (and the 'auto' adapter selector pools
the whole embedding table).

Rank 0 runs the scheduler, block manager and sampler. Before each forward pass it broadcasts the step's
prepared inputs (token ids, positions, slots, attention groups, block copies, logits rows) as one int64
tensor; the other ranks (followers) run the same forward over their shard, and only rank 0 samples. The
broadcast that announces a step goes over a control group with no practical timeout (a server may idle for
days); everything else uses the main group's timeout, so a rank that stops answering fails the step instead
of hanging it. A rank whose process dies closes its sockets, and gloo then fails the others' collectives at
once; NCCL notices at the latest when the step's timeout runs out.

Where the ranks run: on the CPU the main group is gloo; on CUDA it is NCCL, each rank of a host on its own
GPU, cuda:<local rank> (CUDA_VISIBLE_DEVICES picks which GPUs a host lends), and the step's tensors cross the
bus once each way around the broadcast. The control group stays gloo either way: it carries host tensors.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from warmstart.runtime.engine.device import check_device_name, resolve_device
from warmstart.runtime.engine.engine import LLMEngine
from warmstart.runtime.engine.kv_sizing import kv_blocks_for_memory
from warmstart.runtime.engine.model_runner import ModelRunner, StepInputs
from warmstart.runtime.engine.options import EngineOptions
from warmstart.runtime.layers.attention import AttentionGroup, AttentionMetadata
from warmstart.runtime.models.config import ModelConfig
from warmstart.runtime.models.weights import LayerWeights, ModelWeights
from warmstart.runtime.quant.formats import Int8Weight
from warmstart.runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from warmstart.runtime.models.weights import LinearWeight

DEFAULT_TIMEOUT_S = 60.0
_IDLE_TIMEOUT = timedelta(days=365)
_STOP, _STEP = 0, 1


SHARDABLE_SCHEMES = ("none", "int8")


class TensorParallelError(ValueError):
    """A model or snapshot that cannot be split as asked; the message says why and what to do."""


# -- sharding -------------------------------------------------------------------------------------------------


def check_divisible(config: ModelConfig, world: int) -> None:
    if world < 1:
        raise TensorParallelError(f"--tensor-parallel must be >= 1, got {world}")
    if world > 1 and config.moe is not None:
        raise TensorParallelError(f"{config.architecture}'s experts do not split among ranks yet; serve it with "
                                  "--tensor-parallel 1")
    if world > 1 and config.reordered_norms:
        raise TensorParallelError(f"{config.architecture}'s q/k norms span all heads, which a rank holds only part "
                                  "of; serve it with --tensor-parallel 1")
    for what, n in (("num_key_value_heads", config.num_kv_heads), ("num_attention_heads", config.num_heads),
                    ("intermediate_size", config.intermediate_size)):
        if n % world:
            options = [d for d in range(1, n + 1) if n % d == 0 and config.num_kv_heads % d == 0
                       and config.num_heads % d == 0 and config.intermediate_size % d == 0]
            raise TensorParallelError(
                f"{config.architecture} has {what}={n}, which does not divide among {world} ranks "
                f"(each rank must hold whole heads); use --tensor-parallel {' or '.join(map(str, options))}"
            )


def check_shardable(scheme: str, world: int) -> None:
    """Only plain and int8 weights split among ranks: int4's and nf4's groups run along the split columns."""
    if world > 1 and scheme not in SHARDABLE_SCHEMES:
        raise unshardable(scheme)


def unshardable(scheme: str) -> TensorParallelError:
    return TensorParallelError(f"--quant {scheme}'s groups span the split among tensor-parallel ranks; build "
                               "with --quant int8 or none")


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """The config one rank's shard runs as: its own heads and MLP columns, everything else the same."""
    check_divisible(config, world)
    return replace(config, num_heads=config.num_heads // world, num_kv_heads=config.num_kv_heads // world,
                   intermediate_size=config.intermediate_size // world)


def shard_weights(weights: ModelWeights, config: ModelConfig, rank: int, world: int) -> ModelWeights:
    """Rank ``rank``'s part of weights in the engine layout (see the module docstring): plain, or int8.

    int8 scales are per output channel, so a shard of an int8 matrix is exactly the int8 of the shard: its rows
    keep their scales, and a slice of its columns keeps every row's scale. Group-wise int4 and nf4 are refused."""
    check_divisible(config, world)
    if not 0 <= rank < world:
        raise TensorParallelError(f"rank {rank} is outside a group of {world}")
    c = config
    q_rows, kv_rows = c.q_size // world, c.kv_size // world
    inter = c.intermediate_size // world
    qkv_spans = ((rank * q_rows, q_rows), (c.q_size + rank * kv_rows, kv_rows),
                 (c.q_size + c.kv_size + rank * kv_rows, kv_rows))
    layers = []
    for layer in weights.layers:
        assert layer.gate_up is not None and layer.down is not None  # check_divisible refuses experts
        layers.append(LayerWeights(
            input_norm=layer.input_norm,
            qkv=_rows(layer.qkv, qkv_spans),
            qkv_bias=None if layer.qkv_bias is None else _rows(layer.qkv_bias, qkv_spans),
            q_norm=layer.q_norm,  # per head_dim: the same for every head
            k_norm=layer.k_norm,
            o_proj=_columns(layer.o_proj, rank * q_rows, q_rows),
            post_norm=layer.post_norm,
            gate_up=_rows(layer.gate_up, ((rank * inter, inter), (c.intermediate_size + rank * inter, inter))),
            down=_columns(layer.down, rank * inter, inter),
            mlp_out_norm=layer.mlp_out_norm,
            mlp_in_norm=layer.mlp_in_norm,
        ))
    return ModelWeights(embed=weights.embed, layers=layers, norm=weights.norm, lm_head=weights.lm_head)


def _rows(w: LinearWeight, spans: tuple[tuple[int, int], ...]) -> Any:
    def take(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[start : start + n] for start, n in spans]).contiguous()

    if isinstance(w, torch.Tensor):
        return take(w)
    if isinstance(w, Int8Weight):
        return Int8Weight(take(w.qweight), take(w.scales))
    raise _unsplittable(w)


def _columns(w: LinearWeight, start: int, n: int) -> Any:
    if isinstance(w, torch.Tensor):
        return w[:, start : start + n].contiguous()
    if isinstance(w, Int8Weight):
        return Int8Weight(w.qweight[:, start : start + n].contiguous(), w.scales)
    raise _unsplittable(w)


def _unsplittable(w: object) -> TensorParallelError:
    return unshardable(getattr(w, "scheme", type(w).__name__))


def shard_kv(kv: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s KV heads of KV in the pool layout, [num_layers, 2, kv_heads, blocks, block_size, D]."""
    heads = kv.shape[2] // world
    return kv[:, :, rank * heads : (rank + 1) * heads].contiguous()


# -- the group ------------------------------------------------------------------------------------------------


@dataclass
class CommStats:
    """Seconds spent in collectives, as rank 0 sees them. Over NCCL a collective returns once it is queued on
    the GPU, so there these count the queueing; the transfer itself shows in the step's time."""

    steps: int = 0
    all_reduce_seconds: float = 0.0  # summed over every step
    last_step_all_reduce_seconds: float = 0.0
    broadcast_seconds: float = 0.0  # rank 0 sending the step's inputs
    gather_seconds: float = 0.0  # the vocabulary-split logits


def backend_for(device: torch.device) -> str:
    """The collectives' backend for ranks on ``device``: NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: str | torch.device, local_rank: int, local_world: int) -> torch.device:
    """Where the rank ``local_rank`` of the ``local_world`` ranks on this host runs, for a group asked to run on
    ``device`` (auto, cpu or cuda): the CPU, or cuda:<local_rank>. Refused, saying what to do: a GPU index (each
    rank takes its own), and more ranks on this host than GPUs torch sees."""
    name = check_device_name(str(device))
    if ":" in name:
        raise TensorParallelError(f"with tensor parallelism each rank runs on its own GPU, cuda:<rank>: give device "
                                  f"'cuda' (or 'auto'), not {name!r}, and choose the GPUs with CUDA_VISIBLE_DEVICES")
    where = resolve_device(name)  # a clear DeviceError for cuda where torch sees none
    if where.type != "cuda":
        return where
    count = torch.cuda.device_count()
    if local_world > count or local_rank >= count:
        seen = ", ".join(f"cuda:{i}" for i in range(count))
        raise TensorParallelError(
            f"--tensor-parallel {local_world} puts {local_world} ranks on this host, one per GPU, but torch sees "
            f"{count} GPU(s) here ({seen}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
            f"use --tensor-parallel {count} or fewer, or --device cpu"
        )
    return torch.device("cuda", local_rank)


class TensorParallelGroup:
    """This process's place in a tensor-parallel group, joined through torch.distributed's env:// rendezvous
    (MASTER_ADDR, MASTER_PORT; RANK and WORLD_SIZE unless given, LOCAL_RANK and LOCAL_WORLD_SIZE for the ranks
    of this host, as torchrun sets them up). ``device``: auto, cpu or cuda (see rank_device); on CUDA it becomes
    this process's current device, so that what is loaded for the rank lands on its own GPU."""

    def __init__(self, rank: int | None = None, world: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 backend: str | None = None, device: str | torch.device = "cpu") -> None:
        self.rank = int(os.environ["RANK"]) if rank is None else rank
        self.world = int(os.environ["WORLD_SIZE"]) if world is None else world
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.device = rank_device(device, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", self.world)))
        self.backend = backend or backend_for(self.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(self.backend, rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=timeout_s),
                                device_id=self.device if self.device.type == "cuda" else None)
        self.control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        self.stats = CommStats()
        self._step_reduce = 0.0
        self._reduces_per_step = 0
        self._reduces = 0
        self.split_head = False

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's ``partial``, in place; the decoder's hook after o_proj and down."""
        start = time.perf_counter()
        dist.all_reduce(partial)
        self._step_reduce += time.perf_counter() - start
        self._reduces += 1
        if self._reduces == self._reduces_per_step:
            s = self.stats
            s.steps, s.all_reduce_seconds, s.last_step_all_reduce_seconds = (
                s.steps + 1, s.all_reduce_seconds + self._step_reduce, self._step_reduce)
            self._step_reduce, self._reduces = 0.0, 0
        return partial

    def gather_logits(self, partial: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's vocabulary slice of the logits, joined in order; followers get their own back."""
        start = time.perf_counter()
        partial = partial.contiguous()
        parts = [torch.empty_like(partial) for _ in range(self.world)] if self.is_leader else None
        dist.gather(partial, parts, dst=0)
        self.stats.gather_seconds += time.perf_counter() - start
        return torch.cat(parts, dim=-1) if parts is not None else partial

    def attach(self, num_layers: int, split_head: bool) -> None:
        """Count this rank's model in: ``split_head``: its lm_head is this rank's vocabulary slice."""
        self._reduces_per_step = 2 * num_layers
        self.split_head = split_head

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (e.g. KV blocks each rank's memory allows)."""
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def gather_objects(self, obj: object) -> list[object]:
        out: list[object] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.control)
        return out

    # -- the step plan --------------------------------------------------------------------------------------

    def send_step(self, step: StepInputs) -> None:
        """Rank 0: hand the step to every follower (the runner's before_step hook)."""
        start = time.perf_counter()
        payload = encode_step(step)
        dist.broadcast(torch.tensor([_STEP, payload.numel()], dtype=torch.long), 0, group=self.control)
        dist.broadcast(payload.to(self.device), 0)
        self.stats.broadcast_seconds += time.perf_counter() - start

    def receive_step(self) -> StepInputs | None:
        """Followers: the next step's inputs, or None when rank 0 stops the group."""
        header = torch.empty(2, dtype=torch.long)
        dist.broadcast(header, 0, group=self.control)
        if int(header[0]) == _STOP:
            return None
        payload = torch.empty(int(header[1]), dtype=torch.long, device=self.device)
        dist.broadcast(payload, 0)
        return decode_step(payload.cpu(), self.device)

    def stop_followers(self) -> None:
        dist.broadcast(torch.tensor([_STOP, 0], dtype=torch.long), 0, group=self.control)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_engine(config: ModelConfig, shard: ModelWeights, tokenizer: Tokenizer | None, options: EngineOptions,
                group: TensorParallelGroup, split_head: bool = True, pinned_blocks: int = 0) -> LLMEngine:
    """This rank's engine over its ``shard`` of the model ``config`` describes. Every rank gets the same number
    of KV blocks (the fewest any rank's memory allows), so that rank 0's block ids mean the same everywhere.
    Rank 0's runner sends each step to the followers; the caller runs ``follow`` on the others.

    ``split_head``: each rank computes the logits of its slice of the vocabulary (when it divides by the rank
    count), rank 0 gathers them; otherwise rank 0 computes them all. ``pinned_blocks``: see LLMEngine."""
    options.validate()
    if shard.embed.device != group.device:
        raise TensorParallelError(f"rank {group.rank}'s weights are on {shard.embed.device} but its group runs on "
                                  f"{group.device}; load the rank's shard onto {group.device}")
    local = shard_config(config, group.world)
    if options.num_kv_blocks is None:
        max_len = options.context_length(local)
        blocks = kv_blocks_for_memory(local, options, max_len, pinned_blocks=pinned_blocks, device=shard.embed.device)
        options = replace(options, num_kv_blocks=group.min_int(blocks))
    split_head = split_head and config.vocab_size % group.world == 0 and isinstance(shard.lm_head, torch.Tensor)
    if split_head:
        rows = config.vocab_size // group.world
        assert isinstance(shard.lm_head, torch.Tensor)
        shard = replace(shard, lm_head=shard.lm_head[group.rank * rows : (group.rank + 1) * rows])  # a view
    group.attach(len(shard.layers), split_head)
    return LLMEngine.from_weights(
        local, shard, tokenizer, options, reduce=group.all_reduce,
        gather_logits=group.gather_logits if split_head else None,
        before_step=group.send_step if group.is_leader else None, pinned_blocks=pinned_blocks,
    )  # fmt: skip


def follow(runner: ModelRunner, group: TensorParallelGroup) -> None:
    """Followers: run rank 0's steps over this rank's shard until it stops the group (or a collective fails)."""
    no_logits = torch.empty(0, dtype=torch.long, device=runner.device)
    while (step := group.receive_step()) is not None:
        if not group.split_head:
            step.logits_index = no_logits  # rank 0 computes the whole head
        runner.execute(step)


# -- the step plan as one int64 tensor ----------------------------------------------------------------------


def encode_step(step: StepInputs) -> torch.Tensor:
    """Everything a follower needs, flattened into one host tensor (the step's token tensors may be on a GPU)."""
    n = step.input_ids.numel()
    parts: list[torch.Tensor | list[int]] = [
        [n, step.highest_block, len(step.block_copies), len(step.meta.groups), step.logits_index.numel()],
        step.input_ids, step.positions, step.meta.slot_mapping, step.logits_index,
        [i for pair in step.block_copies for i in pair],
    ]
    for g in step.meta.groups:
        rows = g.rows
        b, width = g.block_tables.shape
        head = [0, rows.start, rows.stop] if isinstance(rows, slice) else [1, rows.numel(), 0]
        parts.append([*head, int(g.is_decode), b, width, g.query_positions.numel(), g.first_key_position,
                      g.block_size])
        if not isinstance(rows, slice):
            parts.append(rows)
        parts += [g.block_tables.reshape(-1), g.query_positions]
    return torch.cat([torch.as_tensor(p, dtype=torch.long, device="cpu").reshape(-1) for p in parts])


def decode_step(payload: torch.Tensor, device: torch.device | None = None) -> StepInputs:
    """The step encode_step flattened, from a host tensor; the tensors the model reads go to ``device`` (where
    the follower's shard is), the attention groups' tables stay on the host as the runner makes them."""
    at = 0

    def take(k: int) -> torch.Tensor:
        nonlocal at
        at += k
        return payload[at - k : at]

    n, highest, copies, num_groups, num_logits = take(5).tolist()
    input_ids, positions, slots, logits_index = take(n), take(n), take(n), take(num_logits)
    flat_copies = take(2 * copies).tolist()
    groups = []
    for _ in range(num_groups):
        kind, a, b_, is_decode, b, width, nq, first_key, block_size = take(9).tolist()
        rows: slice | torch.Tensor = slice(a, b_) if kind == 0 else take(a)
        groups.append(AttentionGroup(rows=rows, block_tables=take(b * width).view(b, width),
                                     query_positions=take(nq), first_key_position=first_key,
                                     is_decode=bool(is_decode), block_size=block_size))
    if device is not None:
        input_ids, positions, slots, logits_index = (t.to(device) for t in (input_ids, positions, slots, logits_index))
    return StepInputs(
        input_ids=input_ids, positions=positions, meta=AttentionMetadata(slot_mapping=slots, groups=groups),
        logits_index=logits_index, highest_block=highest,
        block_copies=[(flat_copies[i], flat_copies[i + 1]) for i in range(0, len(flat_copies), 2)],
    )
