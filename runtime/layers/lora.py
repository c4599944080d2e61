"""LoRA over a flat batch of many adapters' rows: the PyTorch path, and the reference the Triton kernel
(runtime/kernels/lora.py) is tested against.

The resident adapters are stacked in ``max_loras`` slots per fused linear (``LoraSlots``), their ranks padded to
``max_rank``: A [slots, slices, max_rank, in], B [slots, out, slices, max_rank] with B block diagonal (output rows
of slice s read only slice s's rank rows; see runtime/engine/lora.py for the adapters' own layout). A step
gives each row of its flat batch a slot or none (``LoraStep``, computed once and used by every layer): the rows
with an adapter are sorted by slot and cut into tiles of ``tile_size`` rows, each tile one adapter's, the last
tile of each adapter padded. Every linear then costs two batched matmuls over all tiles at once, whatever the
number of adapters or requests (Punica's SGMV shrink and expand, in PyTorch): shrink x [tiles, T, in] @
A[tile's slot]ᵀ, expand @ B[tile's slot]ᵀ, added to the base output's rows. With T = ceil(rows / adapters),
there are at most twice as many tiles as adapters in the step and at most twice as many padded rows as rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MODULES = ("qkv", "o_proj", "gate_up", "down")


@dataclass
class LoraSlots:
    """The resident adapters' weights on the model's device, one slot each."""

    a: list[dict[str, torch.Tensor]]  # per layer: module -> [slots, slices, max_rank, in]
    b: list[dict[str, torch.Tensor]]  # per layer: module -> [slots, out, slices, max_rank]
    ranks: list[int]  # per slot: its adapter's rank, 0 when empty
    targets: list[frozenset[str]]  # per slot: the fused modules its adapter adapts

    @classmethod
    def empty(
        cls, max_loras: int, max_rank: int, shapes: dict[str, tuple[int, list[int]]], num_layers: int,
        dtype: torch.dtype, device: torch.device,
    ) -> LoraSlots:  # fmt: skip
        """``shapes``: module -> (in_features, out_features of each slice)."""

        def a(module: str) -> torch.Tensor:
            fan_in, outs = shapes[module]
            return torch.zeros(max_loras, len(outs), max_rank, fan_in, dtype=dtype, device=device)

        def b(module: str) -> torch.Tensor:
            _, outs = shapes[module]
            return torch.zeros(max_loras, sum(outs), len(outs), max_rank, dtype=dtype, device=device)

        return cls([{m: a(m) for m in MODULES} for _ in range(num_layers)],
                   [{m: b(m) for m in MODULES} for _ in range(num_layers)],
                   [0] * max_loras, [frozenset()] * max_loras)

    @property
    def max_rank(self) -> int:
        return self.a[0]["qkv"].shape[2]

    def fill(self, slot: int, rank: int, layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]],
             out_slices: dict[str, list[int]]) -> None:
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
                slices = len(out_slices[module])
                a_slot[:, :rank].copy_(a.view(slices, rank, -1))
                row = 0
                for s, out in enumerate(out_slices[module]):
                    b_slot[row : row + out, s, :rank].copy_(b[row : row + out])
                    row += out
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
    tile_of_row: torch.Tensor  # [m] the tile each of them goes to
    row_in_tile: torch.Tensor  # [m] its place in that tile
    tile_slots: torch.Tensor  # [tiles] the slot of each tile
    tile_starts: torch.Tensor  # [tiles] where each tile's rows start in ``rows`` (the kernel's segments)
    tile_ends: torch.Tensor  # [tiles] and end
    tile_size: int
    rank: int  # the largest rank among the step's adapters: the rank rows computed
    modules: frozenset[str] = field(default_factory=frozenset)  # fused modules any of the step's adapters adapts

    @property
    def num_tiles(self) -> int:
        return int(self.tile_slots.shape[0])



def lora_step(row_slots: list[int], slots: LoraSlots, device: torch.device) -> LoraStep | None:
    """The step's layout for rows carrying slot ``row_slots[i]`` (-1: none); None when no row carries one."""
    per_row = torch.tensor(row_slots, dtype=torch.long)
    rows = torch.nonzero(per_row >= 0).flatten()
    if rows.numel() == 0:
        return None
    slot_of = per_row[rows]
    order = torch.sort(slot_of, stable=True).indices
    rows, slot_of = rows[order], slot_of[order]
    present, counts = torch.unique_consecutive(slot_of, return_counts=True)
    tile_size = -(-rows.numel() // present.numel())
    tiles_per_slot = (counts + tile_size - 1) // tile_size
    first_row = torch.cumsum(counts, 0) - counts  # where each slot's run starts in ``rows``
    first_tile = torch.cumsum(tiles_per_slot, 0) - tiles_per_slot
    place = torch.arange(rows.numel()) - torch.repeat_interleave(first_row, counts)
    tile_of_row = torch.repeat_interleave(first_tile, counts) + place // tile_size
    tile_in_run = torch.arange(int(tiles_per_slot.sum())) - torch.repeat_interleave(first_tile, tiles_per_slot)
    tile_starts = torch.repeat_interleave(first_row, tiles_per_slot) + tile_in_run * tile_size
    tile_ends = torch.minimum(tile_starts + tile_size, torch.repeat_interleave(first_row + counts, tiles_per_slot))
    present_list = present.tolist()
    return LoraStep(
        slots=slots,
        rows=rows.to(device),
        tile_of_row=tile_of_row.to(device),
        row_in_tile=(place % tile_size).to(device),
        tile_slots=torch.repeat_interleave(present, tiles_per_slot).to(device),
        tile_starts=tile_starts.to(device),
        tile_ends=tile_ends.to(device),
        tile_size=tile_size,
        rank=max(slots.ranks[s] for s in present_list),
        modules=frozenset().union(*(slots.targets[s] for s in present_list)),
    )


def add_lora(y: torch.Tensor, x: torch.Tensor, step: LoraStep, layer: int, module: str) -> torch.Tensor:
    """``y`` (the base linear's output for ``x``, [n, out]) plus each row's adapter's B @ A @ x, in place."""
    if module not in step.modules:
        return y
    r = step.rank
    a = step.slots.a[layer][module][step.tile_slots, :, :r].flatten(1, 2)  # [tiles, slices * r, in]
    b = step.slots.b[layer][module][step.tile_slots, :, :, :r].flatten(2, 3)  # [tiles, out, slices * r]
    tiles = x.new_zeros(step.num_tiles, step.tile_size, x.shape[-1])
    tiles[step.tile_of_row, step.row_in_tile] = x[step.rows]
    shrunk = torch.bmm(tiles, a.transpose(1, 2))
    expanded = torch.bmm(shrunk, b.transpose(1, 2))
    return y.index_add_(0, step.rows, expanded[step.tile_of_row, step.row_in_tile])
