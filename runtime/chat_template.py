"""Chat templates rendered as transformers' `apply_chat_template` renders them, without importing transformers.

The environment is the one transformers builds (utils/chat_template_utils.py): a sandbox that cannot change
the objects it is given, `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension ({% break %},
{% continue %}) and the `{% generation %}` tag, `tojson` with `indent`, `separators` and `sort_keys` and without
HTML escaping, and the globals `raise_exception`, `strftime_now`, `dict` and `namespace` (which refuses
underscore-prefixed names). A template sees `messages`, `tools`, `documents`, `add_generation_prompt`, the
tokenizer's special tokens (`bos_token`, `eos_token`, ...) and any extra keyword arguments (a request's
`chat_template_kwargs`, e.g. Qwen3's `enable_thinking`), as transformers passes them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils


class ChatTemplateError(ValueError):
    """The template refused the conversation (its raise_exception), or could not render it."""


def render(source: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
           tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
           special_tokens: Mapping[str, str] | None = None, **kwargs: Any) -> str:
    """The prompt text ``source`` makes of ``messages``; ``kwargs`` win over the special tokens, as in
    transformers (where they are merged into one mapping before rendering)."""
    template = compile_template(source)
    variables = {**(special_tokens or {}), **kwargs}
    try:
        return template.render(messages=messages, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **variables)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template: {e}") from None


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &, '), which a prompt must not hold.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without the class itself (whose attributes lead out of the sandbox)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore-prefixed names (they lead to CPython's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's own signature trick: namespace(self=...) works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())
