"""Weight-only quantization of the linear layers: int8, int4 and nf4, each a small object of plain tensors.

A snapshot stores an object's ``tensors()`` as raw bytes next to its ``meta()`` and rebuilds it with
``from_tensors`` over mapped views, so whatever layout a kernel needs is produced here, at quantize time.

- int8: per output channel, symmetric: w = q * scale, q in [-127, 127].
- int4: groups of ``group_size`` input features, asymmetric: w = (u - 8) * scale + zero, u in [0, 15], packed
  in the layout of PyTorch's CPU int4 kernel. That layout depends on the CPU (see ``int4_layout``); it is
  recorded in the meta, and a weight packed for another CPU is repacked once when it is loaded.
- nf4: 4-bit NormalFloat (QLoRA; the bitsandbytes code book): w = NF4_CODE[u] * absmax of its block of
  ``group_size`` input features; two codes a byte, the first in the high nibble, as bitsandbytes packs them.

Scales are stored in the model's dtype, which is what the kernels multiply by, and codes are chosen against
the stored (rounded) scales, so the error bounds hold for the weights actually used.

Kernels, chosen by measurement (``benchmarks/quant_kernels.py``: SmolLM2-135M shapes, bf16, 2 AVX-512 cores;
times as a multiple of the bf16 matmul at 1 / 16 / 64 / 256 rows):
- int8: ``aten._weight_int8pack_mm`` up to INT8_KERNEL_MAX_ROWS rows (0.4-0.55x / 1.5-1.8x / 2.1-2.7x /
  2.7-2.9x: it costs about as much per row as at one row), above that the int8 tile is converted to bf16 for
  a bf16 matmul (1.3-1.6x at 64, 1.15x at 256). The kernel reads bf16 inputs wrongly when in_features is not
  a multiple of 16 (torch 2.13), so such layers always convert.
- int4: ``aten._weight_int4pack_mm_for_cpu`` up to INT4_KERNEL_MAX_ROWS rows (0.45-0.5x / 1.3-1.6x /
  2.0-2.3x), above that tiles are unpacked and scaled in float32, converted, and multiplied in bf16
  (1.4-1.7x at 256, against 2.3-2.7x for the kernel).
- nf4: PyTorch has no kernel. Tiles of rows are decoded through a lookup table (two bytes -> four codes)
  into a reused buffer, scaled by their block's absmax, and multiplied in bf16: 6-7x / 3.6-3.9x / 2.2-2.5x /
  1.5x. The decode is a gather; PyTorch's fastest gather for it still costs several bf16 matmuls at few rows.
  nf4 is for when 4-bit quality matters more than speed.
"""

from __future__ import annotations

import functools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

# Above these row counts a matmul of converted weights beats the fused kernels (see the module docstring).
INT8_KERNEL_MAX_ROWS = 16
INT4_KERNEL_MAX_ROWS = 64
# Converted weights go through a per-thread buffer of at most this many elements (8 MiB in bf16), a tile of
# rows at a time; one tile holds any matrix of SmolLM2-135M's decoder.
TILE_ELEMENTS = 1 << 22

# QLoRA's NormalFloat-4 code book (bitsandbytes' values), ascending.
NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
])  # fmt: skip


class QuantizedWeight(ABC):
    """A quantized [out_features, in_features] matrix; ``linear(x)`` computes x @ W.T in x's dtype."""

    scheme: ClassVar[str]
    shape: tuple[int, int]

    @abstractmethod
    def linear(self, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The matrix the kernels multiply by, [out_features, in_features]."""

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor to store, by part name; ``from_tensors(meta(), tensors())`` rebuilds the object."""

    @abstractmethod
    def meta(self) -> dict[str, Any]:
        """What ``from_tensors`` needs besides the tensors; plain values only (msgpack-able)."""

    @classmethod
    @abstractmethod
    def from_tensors(cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> QuantizedWeight: ...

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors().values())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.meta()})"


# -- int8 ---------------------------------------------------------------------------------------------------


class Int8Weight(QuantizedWeight):
    scheme = "int8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor) -> None:
        self.qweight = qweight  # int8 [N, K]
        self.scales = scales  # [N], the model's dtype
        self.shape = (qweight.shape[0], qweight.shape[1])

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Int8Weight:
        w32 = w.float()
        scales = _scale(w32.abs().amax(dim=1) / 127, w.dtype)
        q = torch.round(w32 / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scales)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        # The kernel's bf16 path reads inputs wrongly when in_features % 16 != 0 (torch 2.13, AVX-512).
        if x.shape[0] <= INT8_KERNEL_MAX_ROWS and (x.dtype != torch.bfloat16 or self.shape[1] % 16 == 0):
            return self.fused(x)
        return self.converted(x)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales.to(x.dtype))

    def converted(self, x: torch.Tensor) -> torch.Tensor:
        """int8 tiles converted to x's dtype, a matmul, then the scales (the kernel's arithmetic)."""
        y = _tiled_matmul(x, self.shape[0], 1, lambda r0, r1: _buffer_like(self.qweight[r0:r1], x.dtype).t())
        return y.mul_(self.scales.to(x.dtype))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.float() * self.scales.float()[:, None]).to(dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight, "scales": self.scales}

    def meta(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "shape": list(self.shape)}

    @classmethod
    def from_tensors(cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Int8Weight:
        n, k = meta["shape"]
        _expect(meta, tensors, {"qweight": ((n, k), torch.int8), "scales": ((n,), None)})
        return cls(tensors["qweight"], tensors["scales"])


# -- int4 ---------------------------------------------------------------------------------------------------

# PyTorch's CPU int4 packing, per CPU capability: rows are packed in blocks of ``block`` rows, each block as
# [in_features, block / 2] bytes; "halves" puts rows j and j + block/2 in one byte, "pairs" rows 2j and 2j+1
# (low nibble first). A last block of fewer rows is always packed in pairs.
INT4_LAYOUTS = {"avx512": (64, "halves"), "avx2": (32, "halves"), "plain": (32, "pairs")}


@functools.cache
def int4_layout() -> str | None:
    """The layout PyTorch's CPU int4 kernel wants on this machine (found by packing a probe), or None."""
    n, k = 80, 64  # a full block and a partial one for every layout
    probe = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    except (RuntimeError, AttributeError):
        return None
    for name in INT4_LAYOUTS:
        if torch.equal(_int4_codes_t(packed, n, k, name), probe.t().to(torch.uint8)):
            return name
    return None


def _int4_codes_t(packed: torch.Tensor, n: int, k: int, layout: str) -> torch.Tensor:
    """Unpack ``n`` rows of packed int4 codes to uint8 [k, n] (transposed: it is the packing's own order)."""
    block, kind = INT4_LAYOUTS[layout]
    flat = packed.reshape(-1)
    full = n // block * block
    parts = []
    if full:
        b = flat[: full * k // 2].view(full // block, k, block // 2)
        lo, hi = b & 15, b >> 4
        u = torch.cat((lo, hi), -1) if kind == "halves" else torch.stack((lo, hi), -1).flatten(2)
        parts.append(u.transpose(0, 1).reshape(k, full))
    if full < n:
        t = flat[full * k // 2 :].view(k, (n - full) // 2)
        parts.append(torch.stack((t & 15, t >> 4), -1).flatten(1))
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]


def _local_int4_layout() -> str:
    layout = int4_layout()
    if layout is None:
        raise ValueError(
            f"int4 needs PyTorch's CPU int4 kernel, whose weight layout on this machine (torch "
            f"{torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}) warmstart does not "
            "know; use int8 or nf4"
        )
    return layout


class Int4Weight(QuantizedWeight):
    scheme = "int4"

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int, layout: str) -> None:
        self.packed = packed  # uint8 [N, K / 2], in ``layout``
        self.scales_zeros = scales_zeros  # [K / group_size, N, 2]: (scale, zero), the model's dtype
        self.group_size = group_size
        self.layout = layout
        self.shape = (packed.shape[0], packed.shape[1] * 2)

    @classmethod
    def quantize(cls, w: torch.Tensor, group_size: int) -> Int4Weight:
        layout = _local_int4_layout()
        n, k = w.shape
        g = w.float().view(n, k // group_size, group_size)
        lo, hi = g.amin(-1), g.amax(-1)
        scales = _scale((hi - lo) / 15, w.dtype)
        zeros = (lo + 8 * scales.float()).to(w.dtype)
        offset = zeros.float() - 8 * scales.float()  # the value of code 0 under the stored scale and zero
        u = torch.round((g - offset[..., None]) / scales.float()[..., None]).clamp_(0, 15)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.view(n, k).to(torch.int32), 1)
        scales_zeros = torch.stack((scales, zeros), -1).transpose(0, 1).contiguous()
        return cls(packed, scales_zeros, group_size, layout)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x) if x.shape[0] <= INT4_KERNEL_MAX_ROWS else self.converted(x)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        sz = self.scales_zeros.to(x.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, sz)

    def converted(self, x: torch.Tensor) -> torch.Tensor:
        """Tiles unpacked and scaled in float32, converted to x's dtype, then a matmul."""
        n, k = self.shape
        groups = k // self.group_size
        scale = self.scales_zeros[..., 0].float()[:, None, :]  # [groups, 1, N]
        offset = self.scales_zeros[..., 1].float()[:, None, :] - 8 * scale

        def tile(r0: int, r1: int) -> torch.Tensor:
            codes = _int4_codes_t(self.packed[r0:r1], r1 - r0, k, self.layout)
            w32 = _buffer_like(codes, torch.float32)
            w32.view(groups, self.group_size, -1).mul_(scale[..., r0:r1]).add_(offset[..., r0:r1])
            return w32 if x.dtype == torch.float32 else _buffer_like(w32, x.dtype)

        return _tiled_matmul(x, n, INT4_LAYOUTS[self.layout][0], tile)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        u = _int4_codes_t(self.packed, n, k, self.layout).t().float().view(n, -1, self.group_size)
        scale, zero = self.scales_zeros.float().transpose(0, 1).unbind(-1)  # [N, groups] each
        return ((u - 8) * scale[..., None] + zero[..., None]).view(n, k).to(dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "scales_zeros": self.scales_zeros}

    def meta(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "shape": list(self.shape), "group_size": self.group_size, "layout": self.layout}

    @classmethod
    def from_tensors(cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Int4Weight:
        (n, k), gs, layout = meta["shape"], meta["group_size"], meta["layout"]
        if layout not in INT4_LAYOUTS:
            raise ValueError(f"unknown int4 layout {layout!r}; known: {', '.join(INT4_LAYOUTS)}")
        _expect(meta, tensors, {"packed": ((n, k // 2), torch.uint8), "scales_zeros": ((k // gs, n, 2), None)})
        if tensors["packed"].device.type != "cpu":  # the Triton matmul reads every layout as it was stored
            return cls(tensors["packed"], tensors["scales_zeros"], gs, layout)
        packed, local = tensors["packed"], _local_int4_layout()
        if layout != local:  # packed on a CPU of another kind: repack once (a copy) for this one's kernel
            codes = _int4_codes_t(packed, n, k, layout).t().to(torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        return cls(packed, tensors["scales_zeros"], gs, local)


# -- nf4 ----------------------------------------------------------------------------------------------------


class NF4Weight(QuantizedWeight):
    scheme = "nf4"

    def __init__(self, packed: torch.Tensor, absmax: torch.Tensor, group_size: int) -> None:
        self.packed = packed  # uint8 [N, K / 2], row-major, first code of a byte in its high nibble
        self.absmax = absmax  # [N, K / group_size], the model's dtype
        self.group_size = group_size
        self.shape = (packed.shape[0], packed.shape[1] * 2)

    @classmethod
    def quantize(cls, w: torch.Tensor, group_size: int) -> NF4Weight:
        n, k = w.shape
        g = w.float().view(n, k // group_size, group_size)
        absmax = _scale(g.abs().amax(-1), w.dtype)
        midpoints = (NF4_CODE[1:] + NF4_CODE[:-1]) / 2
        u = torch.bucketize(g / absmax.float()[..., None], midpoints).view(n, k // 2, 2).to(torch.uint8)
        return cls((u[..., 0] << 4) | u[..., 1], absmax, group_size)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.shape
        table, per_entry = _nf4_table(x.dtype)
        absmax = self.absmax.to(x.dtype)[..., None]
        entries = self.packed.view(torch.uint16) if per_entry == 4 else self.packed

        def tile(r0: int, r1: int) -> torch.Tensor:
            index = entries[r0:r1].reshape(-1).long()
            out = _buffer(index.numel(), table.dtype)
            w = torch.index_select(table, 0, index, out=out).view(x.dtype).view(r1 - r0, -1, self.group_size)
            return w.mul_(absmax[r0:r1]).view(r1 - r0, k).t()

        return _tiled_matmul(x, n, 1, tile)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        u = torch.stack((self.packed >> 4, self.packed & 15), -1).view(n, -1, self.group_size).long()
        return (NF4_CODE[u] * self.absmax.float()[..., None]).view(n, k).to(dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "absmax": self.absmax}

    def meta(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "shape": list(self.shape), "group_size": self.group_size}

    @classmethod
    def from_tensors(cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> NF4Weight:
        (n, k), gs = meta["shape"], meta["group_size"]
        _expect(meta, tensors, {"packed": ((n, k // 2), torch.uint8), "absmax": ((n, k // gs), None)})
        return cls(tensors["packed"], tensors["absmax"], gs)


@functools.cache
def _nf4_table(dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """Codes for every value of a 2-byte (bf16, fp16) or 1-byte (fp32) index, as one 8-byte entry each:
    a gather of 8-byte entries measured fastest among PyTorch's gathers (index_select, take, embedding)."""
    per_entry = 8 // dtype.itemsize
    index = torch.arange(1 << (4 * per_entry))
    nibbles = []
    for byte in range(per_entry // 2):  # little-endian: the first byte in memory is the low byte
        b = (index >> (8 * byte)) & 255
        nibbles += [b >> 4, b & 15]
    return NF4_CODE[torch.stack(nibbles, -1)].to(dtype).view(torch.int64).view(-1), per_entry


# -- shared -------------------------------------------------------------------------------------------------

# -- a layer's experts ----------------------------------------------------------------------------------------


class QuantizedExperts(QuantizedWeight):
    """A Mixture-of-Experts layer's stacked matrices [experts, N, K], each expert quantized on its own in one
    scheme; stored as every part of theirs stacked along a first dimension of experts."""

    scheme = "experts"

    def __init__(self, experts: list[QuantizedWeight]) -> None:
        self.experts = experts
        self.shape = experts[0].shape  # one expert's

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        raise TypeError("a layer's experts are no one matrix: multiply by .experts[e]")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.stack([e.dequantize(dtype) for e in self.experts])

    def tensors(self) -> dict[str, torch.Tensor]:
        parts = [e.tensors() for e in self.experts]
        return {name: torch.stack([p[name] for p in parts]) for name in parts[0]}

    def meta(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "shape": list(self.shape), "experts": len(self.experts),
                "expert": self.experts[0].meta()}

    @classmethod
    def from_tensors(cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> QuantizedExperts:
        count, inner = int(meta["experts"]), meta["expert"]
        if any(t.shape[0] != count for t in tensors.values()):
            raise ValueError(f"experts weight {meta['shape']}: its parts do not hold {count} experts")
        return cls([from_tensors(inner, {name: t[e] for name, t in tensors.items()}) for e in range(count)])


_CLASSES: dict[str, type[QuantizedWeight]] = {
    c.scheme: c for c in (Int8Weight, Int4Weight, NF4Weight, QuantizedExperts)
}
_scratch = threading.local()


def _scale(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scales in ``dtype``, never zero (an all-zero group, or one below fp16's range, takes the smallest)."""
    return s.clamp(min=torch.finfo(dtype).tiny).to(dtype)


def _buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A per-thread buffer reused by every call: converted tiles live only until their matmul is done."""
    buffers: dict[torch.dtype, torch.Tensor] = _scratch.__dict__.setdefault("buffers", {})
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < numel:
        # A normal tensor even when first made under inference mode: an inference tensor could not be
        # written in place later, outside it.
        with torch.inference_mode(False):
            buf = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def _buffer_like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` converted to ``dtype`` in the buffer for that dtype."""
    return _buffer(t.numel(), dtype).view(t.shape).copy_(t)


def _tiled_matmul(
    x: torch.Tensor, out_features: int, align: int, tile: Callable[[int, int], torch.Tensor]
) -> torch.Tensor:
    """x @ W.T, with ``tile(r0, r1)`` giving W[r0:r1].T converted (in a buffer); tiles of a multiple of
    ``align`` rows, at most TILE_ELEMENTS elements when the matrix allows."""
    k = x.shape[1]
    rows = max(align, TILE_ELEMENTS // k // align * align)
    if rows >= out_features:
        return torch.mm(x, tile(0, out_features))
    y = x.new_empty(x.shape[0], out_features)
    for r0 in range(0, out_features, rows):
        r1 = min(out_features, r0 + rows)
        torch.mm(x, tile(r0, r1), out=y[:, r0:r1])
    return y


def _expect(meta: dict[str, Any], tensors: dict[str, torch.Tensor], parts: dict[str, tuple[tuple, Any]]) -> None:
    for name, (shape, dtype) in parts.items():
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"{meta['scheme']} weight {meta['shape']} has no '{name}' tensor")
        if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
            raise ValueError(
                f"{meta['scheme']} weight {meta['shape']}: '{name}' is {t.dtype} {tuple(t.shape)}, expected "
                f"{dtype or 'float'} {shape}"
            )


def from_tensors(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
    """Rebuild a quantized weight from its meta and tensors (views of a mapped snapshot: nothing is copied,
    except an int4 weight packed for another kind of CPU)."""
    cls = _CLASSES.get(meta.get("scheme", ""))
    if cls is None:
        raise ValueError(f"unknown quantization scheme {meta.get('scheme')!r}; known: {', '.join(_CLASSES)}")
    return cls.from_tensors(meta, tensors)
