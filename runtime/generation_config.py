"""A model's own defaults from its `generation_config.json`, used as vLLM's `--generation-config auto` uses them.

Two things in it change what a server generates: more end-of-sequence ids than config.json names (Llama 3
ends a turn with <|eot_id|> and <|eom_id|>, Qwen with <|im_end|> and <|endoftext|>), which always stop a
request (unless it sets ignore_eos), and the sampling the model's authors recommend, which a request gets for
each field it leaves out. Like vLLM, `do_sample` is not read: a recommended temperature applies even where
transformers' own `generate` would decode greedily.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FILE = "generation_config.json"

# The sampling fields read, as vLLM reads them (it also reads max_new_tokens), with the range each must hold.
SAMPLING_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 100.0),
    "top_p": (0.0, 1.0),  # 0 excluded, checked below
    "top_k": (-1, math.inf),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.0, 2.0),  # 0 excluded, checked below
}


class GenerationConfigError(ValueError):
    """A generation_config.json that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()
    sampling: dict[str, float] = field(default_factory=dict)  # request field -> the model's default

    @classmethod
    def from_dict(cls, raw: Any, source: str = FILE) -> GenerationDefaults:
        if not isinstance(raw, dict):
            raise GenerationConfigError(f"{source} must hold a JSON object, got {type(raw).__name__}")
        return cls(_eos_ids(raw.get("eos_token_id"), source), _sampling(raw, source))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> GenerationDefaults:
        """The defaults of an HF model directory; none when it has no generation_config.json."""
        raw = read_file(Path(model_dir))
        return cls() if raw is None else cls.from_dict(raw, str(Path(model_dir) / FILE))


def read_file(model_dir: Path) -> dict[str, Any] | None:
    """The JSON object of ``model_dir``'s generation_config.json, checked to be usable; None without one."""
    path = model_dir / FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise GenerationConfigError(f"{path} is not valid JSON: {e}") from None
    GenerationDefaults.from_dict(raw, str(path))
    return raw  # type: ignore[no-any-return]


def _eos_ids(value: Any, source: str) -> tuple[int, ...]:
    ids = value if isinstance(value, list) else ([] if value is None else [value])
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise GenerationConfigError(f"{source}: eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(ids)


def _sampling(raw: dict[str, Any], source: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, (lo, hi) in SAMPLING_RANGES.items():
        value = raw.get(name)
        if value is None:
            continue
        positive = name in ("top_p", "repetition_penalty")
        ok = (not isinstance(value, bool) and isinstance(value, int | float) and lo <= value <= hi
              and not (positive and value == 0) and (name != "top_k" or float(value).is_integer()))
        if not ok:
            raise GenerationConfigError(f"{source}: {name} {value!r} is out of range; fix or remove it")
        out[name] = int(value) if name == "top_k" else float(value)
    return out
