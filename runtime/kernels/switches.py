"""The switches that send one CPU kernel's work back to its PyTorch reference (``WARMSTART_CPU_...=torch``)."""

from __future__ import annotations

import os

CHOICES = ("kernel", "torch")


def kernel_chosen(env: str) -> bool:
    """Whether the variable ``env`` (unset or empty: ``kernel``) leaves the kernel on; a value other than
    ``kernel`` or ``torch`` is refused, so that a typo does not silently measure the wrong path."""
    choice = os.environ.get(env) or "kernel"
    if choice not in CHOICES:
        raise ValueError(f"{env}={choice!r} is not one of {', '.join(CHOICES)}")
    return choice == "kernel"
