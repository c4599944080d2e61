"""A SentencePiece-style tokenizer (Llama 2 / Mistral: Metaspace pre-tokenizer and decoder, "▁" for spaces, byte
fallback), trained locally with `tokenizers`, and a tiny model directory that uses it."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

from warmstart.runtime.random_model import SPECIAL_TOKENS

SENTENCES = [
    "Hello world, this is a small corpus for a SentencePiece style tokenizer.",
    "Once upon a time there was a quick brown fox who jumped over the lazy dog.",
    "The weather today is sunny with a chance of rain in the evening and at night.",
    "Numbers like 12, 345 and 6789 appear too, with words such as again, there and world.",
]
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "qu", "ir", "ob", "ul", "en", "ax"]


def corpus() -> list[str]:
    """The sentences, and made-up words enough for a vocabulary as large as the tiny models' (1000)."""
    rnd = random.Random(0)
    words = ["".join(rnd.choice(SYLLABLES) for _ in range(rnd.randrange(1, 4))) for _ in range(20000)]
    return SENTENCES * 4 + [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]


def metaspace_tokenizer(vocab_size: int = 1000) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="first"),
                                     decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=[f"<0x{b:02X}>" for b in range(256)], show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def metaspace_model_dir(src: Path, out: Path) -> Path:
    """A copy of the tiny model directory ``src`` with the Metaspace tokenizer (the same special tokens)."""
    shutil.copytree(src, out)
    metaspace_tokenizer().save(str(out / "tokenizer.json"))
    return out
