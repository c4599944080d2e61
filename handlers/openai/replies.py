"""OpenAI replies out: the whole response body, or its SSE chunks, with usage and logprobs as clients read them."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from warmstart.handlers.openai.reasoning import ReasoningStream, message_fields
from warmstart.handlers.openai.requests import Generation, ServedModel
from warmstart.handlers.openai.tool_calls import ToolCallStream, parse_tool_calls

if TYPE_CHECKING:
    from warmstart.runtime.engine.sequence import TokenLogprobs
    from warmstart.runtime.outputs import RequestOutput

LOGPROB_FLOOR = -9999.0  # -inf is not JSON


def usage(out: RequestOutput | list[RequestOutput]) -> dict[str, Any]:
    """The prompt once (the choices of n > 1 share its computation), and every choice's generated tokens."""
    outs = out if isinstance(out, list) else [out]
    prompt, completion = len(outs[0].prompt_token_ids), sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": outs[0].cached_tokens}}


def best(outs: list[RequestOutput], n: int) -> list[RequestOutput]:
    """The n choices of highest cumulative logprob (best_of; vLLM's ranking), best first; all of them, in
    index order, when there are no more than n."""
    if len(outs) <= n:
        return sorted(outs, key=lambda o: o.index)
    return sorted(outs, key=lambda o: -sum(lp.logprob for lp in o.logprobs or []))[:n]


@dataclass
class Reply:
    """Builds the bodies of one request's response: the whole of it, or its stream of chunks."""

    gen: Generation
    model: ServedModel
    request_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    text_offsets: dict[int, int] = field(default_factory=dict)  # completions logprobs, per choice: where the
    # next token's text starts
    started: set[int] = field(default_factory=set)  # the choices whose first chunk is out
    finals: dict[int, RequestOutput] = field(default_factory=dict)  # streamed choices that finished
    reasoning: dict[int, ReasoningStream] = field(default_factory=dict)  # --reasoning-parser: per choice
    tool_streams: dict[int, ToolCallStream] = field(default_factory=dict)  # chat with tools: per choice

    def _head(self, obj: str) -> dict[str, Any]:
        adapter = self.gen.adapter
        head = {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.gen.model_name or self.model.name,
                "system_fingerprint": self.model.snapshot_id}
        return head if adapter is None else {**head, "adapter": adapter}

    def whole(self, outs: RequestOutput | list[RequestOutput]) -> dict[str, Any]:
        """The response to the finished choices ``outs`` (one output per choice, or the only one)."""
        outs = outs if isinstance(outs, list) else [outs]
        choices = [self._choice(i, out) for i, out in enumerate(best(outs, self.gen.n))]
        body = self._head("chat.completion" if self.gen.chat else "text_completion")
        return {**body, "choices": choices, "usage": usage(outs)}

    def _choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        logprobs = self._with_echo(out, index, out.logprobs or [], True)
        if self.gen.chat:
            message = {"role": "assistant", **message_fields(self.model.reasoning_parser, out.text)}
            reason = out.finish_reason
            if self.gen.tool_parser is not None:
                reply = parse_tool_calls(self.gen.tool_parser, message.get("content") or "")
                if reply.tool_calls:
                    message = {**message, "content": reply.content,
                               "tool_calls": [c.openai() for c in reply.tool_calls]}
                    reason = "tool_calls"
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}
        text = (self.gen.echo or "") + out.text
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason}
        return self._with_prompt_logprobs(choice, out)

    def opening(self) -> list[bytes]:
        """What a stream sends before its first output: nothing, for chat and completions."""
        return []

    def delta(self, out: RequestOutput) -> list[bytes]:
        chunk = self.chunk(out)
        return [] if chunk is None else [sse(chunk)]

    def closing(self, last: RequestOutput) -> list[bytes]:
        return ([sse(self.usage_chunk(last))] if self.gen.include_usage else []) + [SSE_DONE]

    def error(self, body: dict[str, Any]) -> bytes:
        """An error after the stream began (its status line is long gone): an SSE chunk holding the error object."""
        return sse(body)

    def chunk(self, out: RequestOutput) -> dict[str, Any] | None:
        """The SSE chunk for what ``out`` adds, or None when it adds nothing. Each choice's first chunk is sent
        whatever it holds (n > 1: per index). A step that brings
        tokens whose text is held back (part of a UTF-8 character, a possible stop string) still gets its chunk,
        with empty text, as vLLM sends it: clients time tokens by chunks (vLLM's load tester's inter-token
        latency) and count them so."""
        first = out.index not in self.started
        self.started.add(out.index)
        if out.finished:
            self.finals[out.index] = out
        new = out.new_token_ids
        new_lps = (out.logprobs or [])[len(out.token_ids) - len(new) :] if self.gen.logprobs is not None else []
        if not (new or out.new_text or new_lps or out.finished or first):
            return None
        logprobs = self._with_echo(out, out.index, new_lps, first)
        reason = out.finish_reason if out.finished else None
        if self.gen.chat:
            delta = self._delta(out, out.index)
            if "tool_calls" in delta:
                reason = "tool_calls"
            if first:
                delta = {"role": "assistant", **delta}
            choice: dict[str, Any] = {"index": out.index, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": reason}
            body = self._head("chat.completion.chunk")
        else:
            text = (self.gen.echo or "") + out.new_text if first else out.new_text
            choice = {"index": out.index, "text": text, "logprobs": logprobs, "finish_reason": reason}
            if first:
                choice = self._with_prompt_logprobs(choice, out)
            body = self._head("text_completion")
        body["choices"] = [choice]
        if self.gen.include_usage:
            body["usage"] = None
        return body

    def _with_echo(self, out: RequestOutput, index: int, lps: list[TokenLogprobs],
                   first: bool) -> dict[str, Any] | None:  # fmt: skip
        """The logprobs of ``lps``, behind the prompt's on a completion's first chunk when it echoes the prompt."""
        if self.gen.logprobs is None:
            return None
        if self.gen.chat or self.gen.echo is None or not first:
            return self._logprobs(lps, index)
        head = self._prompt_logprobs(out, index)
        body = self._logprobs(lps, index)
        return {key: head[key] + body[key] for key in body}

    def _advance_offsets(self, index: int, tokens: list[str]) -> list[int]:
        """Each token's character offset in choice ``index``'s text so far, which then moves past them."""
        offsets = []
        offset = self.text_offsets.get(index, 0)
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        self.text_offsets[index] = offset
        return offsets

    def _prompt_logprobs(self, out: RequestOutput, index: int) -> dict[str, Any]:
        """Completions' logprobs of the echoed prompt: none for its first token (nothing came before it)."""
        text = self.model.token_text
        entries = out.prompt_logprobs or []
        top_n = self.gen.logprobs
        tokens = [text(t) for t in out.prompt_token_ids]
        offsets = self._advance_offsets(index, tokens)
        return {"tokens": tokens,
                "token_logprobs": [None if lp is None else _finite(lp.logprob) for lp in entries],
                "top_logprobs": [None if lp is None else {text(t): _finite(v) for t, v in _ranked(lp.top, top_n)}
                                 for lp in entries],
                "text_offset": offsets}

    def _with_prompt_logprobs(self, choice: dict[str, Any], out: RequestOutput) -> dict[str, Any]:
        """vLLM's prompt_logprobs beside a completion choice, where asked: per prompt token None (the first)
        or {token id: {logprob, rank, decoded_token}} for the prompt's token and the top-n there."""
        top_n = self.gen.prompt_logprobs
        if top_n is None:
            return choice
        text = self.model.token_text

        def entry(lp: TokenLogprobs) -> dict[str, dict[str, Any]]:
            ranked = _ranked(lp.top, top_n)
            found = {t: {"logprob": _finite(v), "rank": r, "decoded_token": text(t)}
                     for r, (t, v) in enumerate(ranked, start=1)}
            if lp.token_id not in found:
                found = {lp.token_id: {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                       "decoded_token": text(lp.token_id)}, **found}
            return {str(t): v for t, v in found.items()}

        return {**choice, "prompt_logprobs": [None if lp is None else entry(lp) for lp in out.prompt_logprobs or []]}

    def _delta(self, out: RequestOutput, index: int) -> dict[str, Any]:
        """A chat chunk's delta: the new text, or with --reasoning-parser its new reasoning and content."""
        if self.gen.tool_parser is not None:
            calls = self.tool_streams.setdefault(index, ToolCallStream(self.gen.tool_parser))
            return calls.delta(out.new_text, out.finished)
        parser = self.model.reasoning_parser
        if parser is None:
            return {"content": out.new_text}
        stream = self.reasoning.setdefault(index, ReasoningStream(parser))
        return stream.delta_fields(out.new_text, out.finished)

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        """The usage of every choice streamed (``out``, the last output, when none was recorded)."""
        body = self._head("chat.completion.chunk" if self.gen.chat else "text_completion")
        return {**body, "choices": [], "usage": usage([self.finals[i] for i in sorted(self.finals)] or out)}

    def _logprobs(self, lps: list[TokenLogprobs], index: int = 0) -> dict[str, Any]:
        text = self.model.token_text
        if self.gen.chat:
            def entry(token_id: int, lp: float) -> dict[str, Any]:
                s = text(token_id)
                return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode())}

            return {"content": [{**entry(lp.token_id, lp.logprob),
                                 "top_logprobs": [entry(t, v) for t, v in _ranked(lp.top)]} for lp in lps]}
        tokens = [text(lp.token_id) for lp in lps]
        offsets = self._advance_offsets(index, tokens)
        return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for lp in lps],
                "top_logprobs": [{text(t): _finite(v) for t, v in _ranked(lp.top)} for lp in lps],
                "text_offset": offsets}


def _ranked(top: dict[int, float], n: int | None = None) -> list[tuple[int, float]]:
    """The alternatives most likely first; the first ``n`` of them where given."""
    return sorted(top.items(), key=lambda kv: -kv[1])[:n]


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else LOGPROB_FLOOR


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
