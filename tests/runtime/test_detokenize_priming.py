"""Incremental detokenization primed with the prompt, as vLLM primes it: under SentencePiece's Metaspace decoder
(Llama 2, Mistral) a stream's first token loses its leading space, so a stream that starts at the first
generated token would glue it to the prompt ("Hello" + "world")."""

from __future__ import annotations

import random

import pytest

from tests.support.sentencepiece import metaspace_model_dir
from warmstart.runtime.tokenizer import Detokenizer, Tokenizer


@pytest.fixture(scope="module")
def metaspace(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:  # type: ignore[no-untyped-def]
    return Tokenizer(metaspace_model_dir(tiny_model_dir("llama"), tmp_path_factory.mktemp("sp") / "m"))


def streamed(tok: Tokenizer, prompt: list[int], generated: list[int]) -> str:
    detok = Detokenizer(tok, [], prompt_ids=prompt)
    return "".join(detok.add(t).text for t in generated) + detok.flush()


def expected(tok: Tokenizer, prompt: list[int], generated: list[int]) -> str:
    """What the generated tokens add to the decoded text (vLLM's and transformers' streamers' meaning)."""
    return tok.decode(prompt + generated)[len(tok.decode(prompt)):]


@pytest.mark.parametrize(("prompt", "continuation"), [
    ("Hello", " world again"),
    ("Once upon a time there was a quick brown", " fox who jumped"),
])
def test_the_first_generated_token_keeps_its_leading_space(metaspace: Tokenizer, prompt: str,
                                                           continuation: str) -> None:
    assert metaspace.hf.encode("Hello world").tokens[:2] == ["▁Hello", "▁world"]  # SentencePiece-style
    full = metaspace.encode(prompt + continuation, add_special_tokens=False)
    head = metaspace.encode(prompt, add_special_tokens=False)
    assert full[: len(head)] == head
    generated = full[len(head):]
    assert streamed(metaspace, head, generated) == continuation
    assert streamed(metaspace, [], generated) == continuation.lstrip()  # no prompt: the stream's own start


def test_priming_matches_whole_decoding_for_random_tokens(metaspace: Tokenizer, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    rnd = random.Random(0)
    for tok in (metaspace, Tokenizer(tiny_model_dir("llama"))):  # SentencePiece-style and byte-level BPE
        vocab = tok.vocab_size
        for _ in range(30):
            prompt = [rnd.randrange(3, vocab) for _ in range(rnd.randrange(1, 30))]
            generated = [rnd.randrange(3, vocab) for _ in range(rnd.randrange(1, 12))]
            text = expected(tok, prompt, generated)
            if "\ufffd" in text or "\ufffd" in tok.decode(prompt):  # split characters: no single right answer
                continue
            assert streamed(tok, prompt, generated) == text, (prompt, generated)
