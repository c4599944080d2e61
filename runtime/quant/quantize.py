"""Quantizing a float matrix to one of the weight formats (runtime/quant/formats.py), and the checks that
say which group sizes fit which shapes."""

from __future__ import annotations

import torch

from warmstart.runtime.quant.formats import Int4Weight, Int8Weight, NF4Weight, QuantizedWeight

SCHEMES = ("none", "int8", "int4", "nf4")
GROUP_SIZES = (32, 64, 128, 256)  # what PyTorch's int4 kernel accepts; nf4 uses the same choices
DEFAULT_GROUP_SIZE = {"int4": 128, "nf4": 64}  # the largest that fits, up to these, when none is given


def quantize(
    weight: torch.Tensor, scheme: str, group_size: int | None = None, name: str = "weight"
) -> torch.Tensor | QuantizedWeight:
    """Quantize one [out_features, in_features] matrix (``none`` returns it as is). ``group_size`` is int4's
    group and nf4's block along in_features (by default the largest that fits, up to 128 for int4 and 64 for
    nf4); int8 has one scale per output channel."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if scheme == "none":
        return weight
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"{name}: expected a 2-d float matrix, got {weight.dtype} {tuple(weight.shape)}")
    shape = (weight.shape[0], weight.shape[1])
    gs = choose_group_size(scheme, group_size, [shape])
    problem = misfit(shape, scheme, gs)
    if problem:
        raise ValueError(f"{name}: {problem}")
    if scheme == "int8":
        return Int8Weight.quantize(weight)
    if scheme == "int4":
        return Int4Weight.quantize(weight, gs)
    return NF4Weight.quantize(weight, gs)


def choose_group_size(scheme: str, group_size: int | None, shapes: list[tuple[int, int]]) -> int:
    """The given group size, checked; by default the largest up to the scheme's default that fits every
    matrix (SmolLM2's 576 features take 64, not 128), or the default itself when none does."""
    if scheme not in DEFAULT_GROUP_SIZE:
        return 0
    if group_size is None:
        default = DEFAULT_GROUP_SIZE[scheme]
        fits = [g for g in GROUP_SIZES if g <= default and all(misfit(s, scheme, g) is None for s in shapes)]
        return max(fits, default=default)
    if group_size not in GROUP_SIZES:
        raise ValueError(f"{scheme} group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")
    return group_size


def misfit(shape: tuple[int, int], scheme: str, group_size: int) -> str | None:
    """Why a [out, in] matrix cannot take ``scheme`` with ``group_size``, or None."""
    n, k = shape
    if scheme in ("int4", "nf4") and k % group_size:
        return f"in_features {k} is not a multiple of the {scheme} group size {group_size}"
    if scheme == "int4" and n % 16:
        return f"out_features {n} is not a multiple of 16, which PyTorch's int4 kernel needs"
    return None


def check_fits(shapes: dict[str, tuple[int, int]], scheme: str, gs: int) -> None:
    """One error naming every matrix that does not fit, and the group sizes that would."""
    bad = {n: p for n, s in shapes.items() if (p := misfit(s, scheme, gs))}
    if not bad:
        return
    shown = "; ".join(f"{n}: {p}" for n, p in list(bad.items())[:3]) + (" ..." if len(bad) > 3 else "")
    fits = [g for g in GROUP_SIZES if all(misfit(s, scheme, g) is None for s in shapes.values())]
    hint = f"group sizes that fit: {', '.join(map(str, fits))}" if fits else "no group size fits; use int8"
    raise ValueError(f"cannot quantize to {scheme} with group size {gs}: {shown} ({hint})")
