"""vLLM's flags, as a user coming from `vllm serve` types them: taken where they mean the same here, otherwise
refused with the command that takes them (argparse alone answered with the top-level usage)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from warmstart.handlers.errors import CliError, positive_int

# vLLM's serve flag -> what to use here instead (its meaning is fixed when a snapshot is built)
ELSEWHERE = {
    "--dtype": "the snapshot fixes the dtype: give `warmstart build MODEL_DIR --dtype ...` (default auto)",
    "--quantization": "the snapshot fixes the weights' format: give `warmstart build MODEL_DIR --quant int8|int4|nf4`",
}


class TakenElsewhere(argparse.Action):
    """An option that says which command takes it, in the parser's own one-line error (exit 2)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        self.where = kwargs.pop("where")
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        parser.error(f"{parser.prog.split()[-1]} does not take {option_string} (vLLM's serve does): {self.where}")


def add_serve_flags(serve: argparse.ArgumentParser) -> None:
    """vLLM's names on `warmstart serve`."""
    group = serve.add_argument_group("vLLM's names for the options above")
    group.add_argument("--model", dest="model_flag", metavar="REF", help="the snapshot to serve, as SNAPSHOT")
    group.add_argument("--tensor-parallel-size", dest="tensor_parallel", type=positive_int, metavar="N",
                       help="as --tensor-parallel")
    group.add_argument("--enable-lora", action="store_true",
                       help="accepted and needs nothing: LoRA adapters are always served (the snapshot's, and those "
                            "loaded by POST /v1/load_lora_adapter)")
    for flag in ("--dtype", "--quantization"):
        group.add_argument(flag, action=TakenElsewhere, where=ELSEWHERE[flag])


def snapshot_ref(args: argparse.Namespace) -> None:
    """``args.ref`` from the positional REF or vLLM's --model (one of them)."""
    if args.ref is not None and args.model_flag is not None and args.ref != args.model_flag:
        raise CliError(f"serve {args.ref} and --model {args.model_flag} name two snapshots; give one of them")
    args.ref = args.ref if args.ref is not None else args.model_flag
    if args.ref is None:
        raise CliError("name the snapshot to serve: `warmstart serve REF` (a ref name, a snapshot id or its prefix)")
