"""What a request's output must match (vLLM's ``StructuredOutputsParams``): a JSON schema, any JSON object, a
regex, one of a list of strings, or a Lark grammar. Plain data: nothing here imports the grammar engine, which
runtime/engine/structured.py loads when the first constrained request arrives."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict[str, Any] | bool | str | None = None  # a JSON schema (an object, true, or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None  # a Lark grammar (llguidance's dialect)

    def __post_init__(self) -> None:
        self.validate()

    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def validate(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            named = ", ".join(given) or "none"
            raise ValueError(f"structured outputs need exactly one of {', '.join(KINDS)}; got {named}")
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(parsed, dict | bool):
                raise ValueError("a JSON schema must be an object (or true)")
        elif self.json is not None and not isinstance(self.json, dict | bool):
            raise ValueError(f"a JSON schema must be an object, got {type(self.json).__name__}")
        if self.json is False:
            raise ValueError("the JSON schema false matches nothing")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list | tuple) or not self.choice
            or any(not isinstance(c, str) or not c for c in self.choice)
        ):  # fmt: skip
            raise ValueError("choice must be a non-empty list of non-empty strings")

    def schema(self) -> dict[str, Any] | bool:
        """The JSON schema, parsed (json requests only)."""
        return json.loads(self.json) if isinstance(self.json, str) else self.json  # type: ignore[return-value]

    def key(self) -> str:
        """A hash naming what is asked for: two requests with the same key share a compiled grammar."""
        kind = self.kind()
        value: Any = self.schema() if kind == "json" else getattr(self, kind)
        text = json.dumps([kind, list(value) if kind == "choice" else value], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()
