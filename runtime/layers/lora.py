"""LoRA over a flat batch of many adapters' rows: the PyTorch path, and the reference the Triton kernel
(runtime/kernels/lora.py) is tested against.

The resident adapters are stacked in ``max_loras`` slots per fused linear (``LoraSlots``), their ranks padded to
``max_rank``, transposed for the matmuls (bfloat16 bmm on the CPU is many times slower with a transposed operand):
Aᵀ [slots, in, slices, max_rank] and Bᵀ [slots, max_rank, out], whose output columns of slice s (q, k, v or
gate, up) multiply slice s's rank rows of the shrunk product (see runtime/engine/lora.py for the adapters' own
layout; no block-diagonal zeros, which would be a third more bytes read per decode step). A step
gives each row of its flat batch a slot or none (``LoraStep``, computed once and used by every layer): the rows
with an adapter are sorted by slot and cut into tiles of ``tile_size`` rows, each tile one adapter's, the last
tile of each adapter padded. Every linear then costs two batched matmuls over all tiles at once, whatever the
number of adapters or requests (Punica's SGMV shrink and expand, in PyTorch): shrink x [tiles, T, in] @
A[tile's slot]ᵀ, expand each slice's part @ its columns of B[tile's slot]ᵀ, added to the base output's rows.
With T = ceil(rows / adapters), there are at most twice as many tiles as adapters in the step and at most
twice as many padded rows as rows; one tile per slot (``LoraStep.by_slot``) when that pads little.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MODULES = ("qkv", "o_proj", "gate_up", "down")


@dataclass
class LoraSlots:
    """The resident adapters' weights on the model's device, one slot each."""

    a: list[dict[str, torch.Tensor]]  # per layer: module -> Aᵀ [slots, in, slices, max_rank]
    b: list[dict[str, torch.Tensor]]  # per layer: module -> Bᵀ [slots, max_rank, out]
    ranks: list[int]  # per slot: its adapter's rank, 0 when empty
    targets: list[frozenset[str]]  # per slot: the fused modules its adapter adapts
    out_slices: dict[str, list[int]]  # module -> out_features of each slice

    @classmethod
    def empty(
        cls, max_loras: int, max_rank: int, shapes: dict[str, tuple[int, list[int]]], num_layers: int,
        dtype: torch.dtype, device: torch.device,
    ) -> LoraSlots:  # fmt: skip
        """``shapes``: module -> (in_features, out_features of each slice)."""

        def a(module: str) -> torch.Tensor:
            fan_in, outs = shapes[module]
            return torch.zeros(max_loras, fan_in, len(outs), max_rank, dtype=dtype, device=device)

        def b(module: str) -> torch.Tensor:
            _, outs = shapes[module]
            return torch.zeros(max_loras, max_rank, sum(outs), dtype=dtype, device=device)

        return cls([{m: a(m) for m in MODULES} for _ in range(num_layers)],
                   [{m: b(m) for m in MODULES} for _ in range(num_layers)],
                   [0] * max_loras, [frozenset()] * max_loras, {m: list(shapes[m][1]) for m in MODULES})

    @property
    def max_rank(self) -> int:
        return self.a[0]["qkv"].shape[3]

    def fill(self, slot: int, rank: int, layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Put one adapter (per layer: module -> (A [slices * rank, in], B [out, rank])) into ``slot``."""
        if rank > self.max_rank:
            raise ValueError(f"an adapter of rank {rank} does not fit slots of rank {self.max_rank}")
        targets = set()
        for i, modules in enumerate(layers):
            for module in MODULES:
                a_slot, b_slot = self.a[i][module][slot], self.b[i][module][slot]
                a_slot.zero_()
                b_slot.zero_()
                if module not in modules:
                    continue
                targets.add(module)
                a, b = modules[module]
                slices = len(self.out_slices[module])
                a_slot[:, :, :rank].copy_(a.view(slices, rank, -1).permute(2, 0, 1))
                b_slot[:rank].copy_(b.t())
        self.ranks[slot] = rank
        self.targets[slot] = frozenset(targets)

    def clear(self, slot: int) -> None:
        self.ranks[slot] = 0
        self.targets[slot] = frozenset()


@dataclass
class LoraStep:
    """Which rows of a step's flat batch carry which slot, laid out in tiles (see the module docstring)."""

    slots: LoraSlots
    rows: torch.Tensor  # [m] the rows with an adapter, sorted by slot
    row_position: torch.Tensor  # [m] their places in the padded tiles, tile * tile_size + place in the tile
    pad_source: torch.Tensor  # [tiles * tile_size] the row each padded place reads and adds to (padding: rows[0])
    padding: torch.Tensor | None  # [tiles, tile_size, 1] True at padding places, whose products are zeroed; None: none
    tile_slots: torch.Tensor  # [tiles] the slot of each tile
    tile_starts: torch.Tensor  # [tiles] where each tile's rows start in ``rows`` (the kernel's segments)
    tile_ends: torch.Tensor  # [tiles] and end
    tile_size: int
    rank: int  # the rank rows computed: the step's adapters' largest, or the slots' when by_slot
    # One tile per slot, in slot order, every slot (some empty): the stacked weights are used as they lie, not
    # gathered. Chosen when the rows spread evenly enough over the slots (decode steps, mostly).
    by_slot: bool = False
    modules: frozenset[str] = field(default_factory=frozenset)  # fused modules any of the step's adapters adapts
    # fused module -> each slot's rank where its adapter adapts that module, else 0: int64 [slots] on the CPU, for
    # the CPU kernel (runtime/kernels/cpu_lora.py), which computes only those ranks' columns
    module_ranks: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tiles(self) -> int:
        return int(self.tile_slots.shape[0])


def lora_step(row_slots: list[int], slots: LoraSlots, device: torch.device) -> LoraStep | None:
    """The step's layout for rows carrying slot ``row_slots[i]`` (-1: none); None when no row carries one.

    Tiles of ceil(rows / adapters) rows, or one tile per slot (``by_slot``) when padding every slot to the
    busiest one's rows would at most double the rows computed."""
    per_row = torch.tensor(row_slots, dtype=torch.long)
    rows = torch.nonzero(per_row >= 0).flatten()
    m = rows.numel()
    if m == 0:
        return None
    slot_of = per_row[rows]
    order = torch.sort(slot_of, stable=True).indices
    rows, slot_of = rows[order], slot_of[order]
    num_slots = len(slots.ranks)
    per_slot = torch.bincount(slot_of, minlength=num_slots)
    present = torch.nonzero(per_slot).flatten()
    by_slot = num_slots * int(per_slot.max()) <= 2 * m
    if by_slot:
        run_slots, run_counts, tile_size = torch.arange(num_slots), per_slot, int(per_slot.max())
        tiles_per_run = torch.ones(num_slots, dtype=torch.long)
    else:
        run_slots, run_counts, tile_size = present, per_slot[present], -(-m // present.numel())
        tiles_per_run = (run_counts + tile_size - 1) // tile_size
    first_row = torch.cumsum(run_counts, 0) - run_counts  # where each run starts in ``rows``
    first_tile = torch.cumsum(tiles_per_run, 0) - tiles_per_run
    place = torch.arange(m) - torch.repeat_interleave(first_row, run_counts)
    tile_of_row = torch.repeat_interleave(first_tile, run_counts) + place // tile_size
    num_tiles = int(tiles_per_run.sum())
    tile_in_run = torch.arange(num_tiles) - torch.repeat_interleave(first_tile, tiles_per_run)
    tile_starts = torch.repeat_interleave(first_row, tiles_per_run) + tile_in_run * tile_size
    tile_ends = torch.minimum(tile_starts + tile_size, torch.repeat_interleave(first_row + run_counts, tiles_per_run))
    row_position = tile_of_row * tile_size + place % tile_size
    pad_source = torch.full((num_tiles * tile_size,), int(rows[0]), dtype=torch.long)
    pad_source[row_position] = rows
    padding = None
    if num_tiles * tile_size > m:
        padding = torch.ones(num_tiles * tile_size, dtype=torch.bool)
        padding[row_position] = False
        padding = padding.view(num_tiles, tile_size, 1).to(device)
    present_list = present.tolist()
    return LoraStep(
        slots=slots,
        rows=rows.to(device),
        row_position=row_position.to(device),
        pad_source=pad_source.to(device),
        padding=padding,
        tile_slots=torch.repeat_interleave(run_slots, tiles_per_run).to(device),
        tile_starts=tile_starts.to(device),
        tile_ends=tile_ends.to(device),
        tile_size=tile_size,
        rank=slots.max_rank if by_slot else max(slots.ranks[s] for s in present_list),
        by_slot=by_slot,
        modules=frozenset().union(*(slots.targets[s] for s in present_list)),
        module_ranks={m: torch.tensor([r if m in t else 0 for r, t in zip(slots.ranks, slots.targets, strict=True)])
                      for m in MODULES},
    )


def add_lora(y: torch.Tensor, x: torch.Tensor, step: LoraStep, layer: int, module: str) -> torch.Tensor:
    """``y`` (the base linear's output for ``x``, [n, out]) plus each row's adapter's B @ A @ x, in place."""
    if module not in step.modules:
        return y
    a, b = step.slots.a[layer][module], step.slots.b[layer][module]
    r = step.rank
    if step.by_slot:  # every slot's weights, as stored: no copy
        a = a.flatten(2, 3)
    else:
        a = a[step.tile_slots, :, :, :r].flatten(2, 3)  # [tiles, in, slices * r]
        b = b[step.tile_slots, :r]  # [tiles, r, out]
    tiles = x.index_select(0, step.pad_source).view(step.num_tiles, step.tile_size, x.shape[-1])
    shrunk = torch.bmm(tiles, a)
    parts, column = [], 0
    for s, out in enumerate(step.slots.out_slices[module]):  # the slices (1 to 3), not the requests
        parts.append(torch.bmm(shrunk[..., s * r : (s + 1) * r], b[..., column : column + out]))
        column += out
    expanded = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    if step.padding is not None:
        # padding places add exactly zero (to rows[0]: no gather of the products); zeroed at the end, since a zero
        # times a NaN or infinite weight of their tile's adapter is NaN, which would reach another request's row
        expanded.masked_fill_(step.padding, 0)
    return y.index_add_(0, step.pad_source, expanded.view(-1, y.shape[-1]))
