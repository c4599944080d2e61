"""Tokenizing, chat templates and streaming detokenization with ``tokenizers`` and ``jinja2`` only."""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from warmstart.runtime import chat_template
from warmstart.runtime.chat_content import ContentShield

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialized as an object
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json (a fast tokenizer file is required)")
        config_path = model_dir / "tokenizer_config.json"
        template_path = model_dir / "chat_template.jinja"
        self._load(
            path,
            config_path if config_path.is_file() else None,
            template_path if template_path.is_file() else None,
        )

    @classmethod
    def from_files(
        cls, tokenizer_json: Path, tokenizer_config: Path | None = None, chat_template: Path | None = None
    ) -> Tokenizer:
        """From files that need not sit in a model directory (a snapshot's cached blobs)."""
        tokenizer = cls.__new__(cls)
        tokenizer._load(tokenizer_json, tokenizer_config, chat_template)
        return tokenizer

    def _load(self, tokenizer_json: Path, tokenizer_config: Path | None, chat_template: Path | None) -> None:
        self.hf = HFTokenizer.from_file(str(tokenizer_json))
        # The same tokenizer reading special-token text as plain text (runtime/chat_content.py): a second instance,
        # since the switch is the tokenizer's and requests are tokenized on several threads.
        self.plain_hf = HFTokenizer.from_file(str(tokenizer_json))
        self.plain_hf.encode_special_tokens = True
        self.special_texts = [t.content for t in self.hf.get_added_tokens_decoder().values() if t.special]
        config: dict[str, Any] = json.loads(tokenizer_config.read_text()) if tokenizer_config else {}
        self.chat_template: str | None = config.get("chat_template")
        if self.chat_template is None and chat_template is not None:
            self.chat_template = chat_template.read_text()
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        # What transformers' apply_chat_template shows a template beside the messages (its special_tokens_map).
        self.special_tokens = {name: text for name in SPECIAL_TOKEN_NAMES
                               if (text := _token_text(config.get(name))) is not None}
        self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch call releases the GIL while it works (`encode` holds it, about 1 s per MB), so a server
        # tokenizing in a thread keeps streaming; "fast" skips the character offsets, which nothing here reads.
        return list(self.hf.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """As transformers renders it (runtime/chat_template.py); ``kwargs``: tools, documents and any variable the
        template reads (a request's chat_template_kwargs)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain completion prompt instead")
        return chat_template.render(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    special_tokens=self.special_tokens, **kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                    special_tokens_in_content: bool = False, **kwargs: Any) -> list[int]:
        """The prompt's token ids. Special-token text in the messages, tools, documents or ``kwargs`` stays text
        (runtime/chat_content.py) unless ``special_tokens_in_content``; the template's own are special tokens."""
        # The template already writes the special tokens it wants (as HF's apply_chat_template assumes).
        if special_tokens_in_content:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                               add_special_tokens=False)
        shield = ContentShield(self.special_texts)
        rendered = self.apply_chat_template(shield.cover(messages), add_generation_prompt, **shield.cover(kwargs))
        ids: list[int] = []
        for text, from_content in shield.pieces(rendered):
            if from_content:
                ids += self.plain_hf.encode(text, add_special_tokens=False).ids
            else:
                ids += self.encode(text, add_special_tokens=False)
        return ids

    def system_prompt_tokens(self, text: str) -> list[int]:
        """The tokens every chat request whose system message is ``text`` starts with.

        Rendered with two unlike user turns, the common start covers the system turn and the user turn's
        header, which is exactly what the template writes before any user text.
        """
        renders = [
            self.encode_chat([{"role": "system", "content": text}, {"role": "user", "content": user}])
            for user in ("Hello!", "7 + 5 = ?")
        ]
        common = 0
        for a, b in zip(*renders, strict=False):
            if a != b:
                break
            common += 1
        return renders[0][:common]


@dataclass
class TextDelta:
    text: str
    stopped: bool  # a stop string was found; the text ends before it (or after it, if asked)


class Detokenizer:
    """Turns one request's generated tokens into text as they come and finds its stop strings.

    Text that could still turn out to be the start of a stop string is held back until it cannot. With
    ``skip_special_tokens`` False the text keeps special tokens, except ``end_ids`` (the tokens that end the
    request: EOS), whose text vLLM leaves out too.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str], include_stop: bool = False,
                 prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True,
                 end_ids: Collection[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.end_ids = frozenset(() if skip_special_tokens else end_ids)
        for token_id in _priming_suffix(tokenizer, prompt_ids):
            self._step(token_id)
        self.stop = stop
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # everything decoded so far
        self.emitted = 0  # characters of ``text`` already handed out

    def add(self, token_id: int) -> TextDelta:
        piece = self._step(token_id)
        search_from = max(0, len(self.text) - self.hold)
        self.text += piece
        found = [(at, s) for s in self.stop if (at := self.text.find(s, search_from)) >= 0]
        if found:
            at, s = min(found)
            self.text = self.text[: at + len(s) if self.include_stop else at]
            return TextDelta(self._take(len(self.text)), stopped=True)
        return TextDelta(self._take(len(self.text) - self.hold), stopped=False)

    def _step(self, token_id: int) -> str:
        if token_id in self.end_ids:
            return ""
        try:
            return self.stream.step(self.tokenizer.hf, token_id) or ""
        except Exception:  # an id the tokenizer lacks (model vocab padded past the tokenizer's)
            return ""

    def flush(self) -> str:
        """The held-back tail, once the request has finished for another reason."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        end = max(end, self.emitted)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out


def _priming_suffix(tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> Sequence[int]:
    """The prompt tokens a decode stream is primed with, as vLLM primes it: decoded alone, the first token of a
    stream loses its leading space under SentencePiece's Metaspace decoder (Llama 2, Mistral), so the first
    generated token must not be the stream's first. The shortest tail of 4 to 23 tokens that decodes to whole
    characters; the whole prompt when it is shorter than 5 tokens; the last 23 when no tail does (vLLM steps
    through the whole prompt then, which costs time in proportion to its length)."""
    if len(prompt_ids) <= 4:
        return prompt_ids
    for length in range(4, min(len(prompt_ids) + 1, 24)):
        tail = prompt_ids[-length:]
        try:
            text = tokenizer.hf.decode(list(tail), skip_special_tokens=True)
        except Exception:  # ids past the tokenizer's vocabulary
            continue
        if "\ufffd" not in text:
            return tail
    return prompt_ids[-23:]
