"""What a request's output must match, from whichever field it was asked by: OpenAI's ``response_format``
(json_object, json_schema), vLLM's ``structured_outputs`` object or its older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``. Checked here, grammar compiled included, so that a bad schema is a 400
naming what is wrong before the request reaches the engine."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the runtime imports torch; this module is imported before the server listens
    from warmstart.runtime.structured_outputs import StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
FIELDS = {"response_format", "structured_outputs", *GUIDED}
STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20  # a schema or grammar past a megabyte is no real request
# Checking a choice list compiles its grammar in the request-parsing pool, which every request shares: 4,096
# choices took 0.04 s here, 60,000 about 2 s (during which other requests waited to be parsed).
MAX_CHOICES = 4096


class StructuredFieldError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def structured_outputs(raw: dict[str, Any]) -> StructuredOutputsParams | None:
    """The request's constraint, or None; raises StructuredFieldError naming the field and the problem."""
    asked = {name: raw[name] for name in FIELDS if raw.get(name) is not None}
    if asked.get("response_format") == {"type": "text"}:
        del asked["response_format"]
    if len(asked) > 1:
        names = sorted(asked)
        raise StructuredFieldError(f"{' and '.join(names)} both constrain the output; send one of them", names[1])
    if not asked:
        return None
    (name, value), = asked.items()
    if len(json.dumps(value)) > MAX_SPEC_CHARS:
        raise StructuredFieldError(f"{name} is larger than {MAX_SPEC_CHARS} characters", name)
    if name == "response_format":
        kwargs = _response_format(value)
    elif name == "structured_outputs":
        kwargs = _structured_outputs(value)
    else:
        kwargs = {GUIDED[name]: value}
    return _checked(kwargs, name)


def _response_format(value: Any) -> dict[str, Any]:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise StructuredFieldError('response_format must be {"type": "text"}, {"type": "json_object"} or '
                                   '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}, got '
                                   f"{json.dumps(value)[:80]}", "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise StructuredFieldError("response_format.json_schema must be an object with name and schema",
                                   "response_format")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise StructuredFieldError("response_format.json_schema.name is required (a string)", "response_format")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise StructuredFieldError("response_format.json_schema.strict must be true or false", "response_format")
    schema = spec.get("schema")
    if schema is None:  # OpenAI's schema is optional: then any JSON object
        return {"json_object": True}
    if not isinstance(schema, dict):
        raise StructuredFieldError("response_format.json_schema.schema must be a JSON schema object",
                                   "response_format")
    return {"json": schema}


def _structured_outputs(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise StructuredFieldError(f"structured_outputs must be an object with one of {', '.join(STRUCTURED_KEYS)}",
                                   "structured_outputs")
    unknown = sorted(k for k in value if k not in STRUCTURED_KEYS)
    if unknown:
        raise StructuredFieldError(f"structured_outputs.{unknown[0]} is not supported by this server (it supports "
                                   f"{', '.join(STRUCTURED_KEYS)})", "structured_outputs")
    if "json_object" in value and not isinstance(value["json_object"], bool):
        raise StructuredFieldError("structured_outputs.json_object must be true or false", "structured_outputs")
    return {k: v for k, v in value.items() if v is not None}


def _checked(kwargs: dict[str, Any], param: str) -> StructuredOutputsParams:
    from warmstart.runtime.engine.structured import check_grammar
    from warmstart.runtime.structured_outputs import StructuredOutputsParams

    choice = kwargs.get("choice")
    if isinstance(choice, list | tuple) and len(choice) > MAX_CHOICES:
        raise StructuredFieldError(f"{param}: {len(choice)} choices; at most {MAX_CHOICES} are accepted (for more, "
                                   "constrain the output with a regex or a grammar)", param)
    try:
        spec = StructuredOutputsParams(**kwargs)
        check_grammar(spec)
    except (ValueError, TypeError) as e:
        raise StructuredFieldError(f"{param}: {e}", param) from None
    return spec
