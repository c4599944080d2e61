"""What the command line shares: the error a user can fix, and argument types."""

from __future__ import annotations

import argparse


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
