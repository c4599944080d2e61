"""The standard request mixes of ../shared/bench/workloads.json, drawn the same way for every system."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED_BENCH = REPO.parent / "shared" / "bench"


@dataclass
class Request:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float


def load_workload(name: str, vocab_size: int, path: Path | None = None, scale: float = 1.0) -> list[Request]:
    """Requests of workload ``name``; ``scale`` < 1 keeps that fraction of them (for quick runs)."""
    path = path or SHARED_BENCH / "workloads.json"
    spec_all = json.loads(path.read_text())
    if name not in spec_all["workloads"]:
        raise SystemExit(f"unknown workload {name!r}; {path} has {', '.join(spec_all['workloads'])}")
    spec = spec_all["workloads"][name]
    rng = random.Random(spec_all["seed"])

    def tokens(n: int) -> list[int]:
        return [rng.randrange(16, vocab_size - 16) for _ in range(n)]

    system = tokens(spec.get("system_prompt_tokens", 0))
    arrival = spec.get("arrival", "burst")
    count = max(1, round(spec["requests"] * scale))
    t = 0.0
    out = []
    for _ in range(count):
        prompt = system + tokens(rng.randint(*spec["prompt_tokens"]))
        max_tokens = rng.randint(*spec["max_tokens"])
        if isinstance(arrival, dict):
            t += rng.expovariate(arrival["poisson_per_second"])
        out.append(Request(prompt, max_tokens, t))
    return out


def save_requests(requests: list[Request], path: Path) -> None:
    path.write_text(json.dumps([asdict(r) for r in requests]))


def read_requests(path: Path) -> list[Request]:
    return [Request(**r) for r in json.loads(path.read_text())]


WORDS = ("system", "policy", "answer", "user", "always", "politely", "context", "document", "careful", "brief")


def text_of_tokens(tokenizer, n_tokens: int) -> str:  # type: ignore[no-untyped-def]
    """Plain English-like text that tokenizes to at least ``n_tokens`` tokens (a long system prompt)."""
    words: list[str] = []
    i = 0
    while len(tokenizer.encode(" ".join(words))) < n_tokens:
        words.extend(WORDS[(i * 7 + j) % len(WORDS)] for j in range(64))
        i += 1
    return " ".join(words) + "."
