"""`warmstart prepare-model NAME`: a real checkpoint converted once into the local cache; prints its directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from warmstart.handlers.errors import CliError


def add_command(sub: Any) -> None:
    from warmstart.snapshot.prepare_model import KNOWN_MODELS

    p = sub.add_parser("prepare-model", help="download and convert a real model into an HF directory (cached)")
    p.add_argument("name", choices=sorted(KNOWN_MODELS), help="the model")
    p.add_argument("--dir", type=Path, help="where to write it (default ~/.cache/warmstart/models/NAME)")
    p.add_argument("--gguf", type=Path, metavar="FILE", help="convert this local GGUF file instead of downloading")
    p.set_defaults(func=cmd_prepare_model)


def cmd_prepare_model(args: argparse.Namespace) -> int:
    from warmstart.snapshot.prepare_model import PrepareError, prepare_model

    if args.gguf is not None and not args.gguf.is_file():
        raise CliError(f"--gguf {args.gguf}: no such file")
    try:
        model_dir = prepare_model(args.name, args.dir, gguf_file=args.gguf, log=lambda m: print(m, file=sys.stderr))
    except PrepareError as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"cannot write the model: {e}") from None
    print(model_dir)
    return 0
