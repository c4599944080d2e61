"""What the command line shares: the error a user can fix, and argument types."""

from __future__ import annotations

import argparse
import os
import re


class CliError(Exception):
    """An error the user can fix; printed as one line, no traceback."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return int(text)


def port_number(text: str) -> int:
    if not text.strip().isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number from 0 to 65535, got {text!r}")
    return int(text)


DEVICE_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")


def device_name(text: str) -> str:
    """auto, cpu, cuda or cuda:N, checked without importing torch (serving listens before it does); whether the
    device exists is checked when the engine loads (runtime.engine.device.resolve_device)."""
    name = text.strip().lower()
    if not DEVICE_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return name


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:  # NaN too
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


CPU_ISA_ENV = "WARMSTART_CPU_ISA"
# runtime/kernels/isa.py's LEVELS, which a test keeps equal
CPU_ISA_LEVELS = ("portable", "avx2", "avx512", "avx512_bf16")


def check_environment() -> None:
    """The variables that would stop the runtime's import, checked before it (which imports torch) in one line."""
    level = os.environ.get(CPU_ISA_ENV)
    if level and level not in CPU_ISA_LEVELS:
        raise CliError(f"{CPU_ISA_ENV}={level!r} is not an instruction set level: use one of "
                       f"{', '.join(CPU_ISA_LEVELS)} (it only lowers what this CPU runs), or unset it")
