"""Speculative decoding end to end: a snapshot built with a draft model, served with --speculative draft,
with its counters at /metrics and /status and a per-request off switch over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from tests.support.cli import WARMSTART
from tests.support.model_configs import FAMILIES
from tests.support.serving import DOC_TEXT, SYSTEM_TEXT
from warmstart.handlers.cli.main import build_parser
from warmstart.handlers.server.app import create_app
from warmstart.handlers.server.state import Limits, ServeState, load_snapshot
from warmstart.handlers.server.timeline import cold_start_timeline
from warmstart.runtime import SamplingParams
from warmstart.runtime.engine.speculative import DraftProposer
from warmstart.runtime.random_model import make_random_model, perturb_model
from warmstart.snapshot.build import BuildError, BuildOptions, PrefixSpec, build_snapshot
from warmstart.snapshot.cache import BlobCache
from warmstart.snapshot.loader import SnapshotError, load
from warmstart.snapshot.stores import open_store
from warmstart.snapshot.transfer import push_snapshot

REF = "tiny-spec"
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def snap(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("spec-serve")
    model = tiny_model_dir("llama")
    draft = perturb_model(model, root / "draft", 0.02, seed=1)
    (root / "system.txt").write_text(SYSTEM_TEXT)
    (root / "doc.txt").write_text(DOC_TEXT)
    prefixes = [PrefixSpec("assistant", root / "system.txt", "system"), PrefixSpec("doc", root / "doc.txt", "text")]
    options = BuildOptions(dtype="float32", prefixes=prefixes, draft=draft, draft_quant="int8")
    built = build_snapshot(model, options, BlobCache(root / "cache"))
    store = open_store(str(root / "store"))
    push_snapshot(store, built.manifest.encode(), built.id, built.blob_paths)
    store.set_ref(REF, built.id)
    return {"root": root, "model": model, "draft": draft, "manifest": built.manifest.data}


def serve_state(snap: dict[str, Any], **options: Any) -> ServeState:
    state = ServeState(REF, REF, cold_start_timeline(), Limits())
    load_snapshot(state, str(snap["root"] / "store"), snap["root"] / "cache",
                  {"num_kv_blocks": 64, "max_model_len": 256, **options})
    assert state.status == "ready", state.error
    return state


@pytest.fixture(scope="module")
def client(snap: dict[str, Any]) -> Iterator[TestClient]:
    state = serve_state(snap, speculative="draft", num_speculative_tokens=3)
    with TestClient(create_app(state)) as c:
        yield c
    state.shutdown()


def metric(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(f"warmstart:{name}"))
    return float(line.split()[-1])


def test_the_draft_is_stored_as_its_own_quantized_blobs_with_prefix_kv(snap: dict[str, Any]) -> None:
    m = snap["manifest"]
    draft = m["draft"]
    assert draft["quantization"]["scheme"] == "int8" and m["quantization"]["scheme"] == "none"
    draft_blobs = {t["blob"] for t in draft["tensors"].values()}
    assert draft_blobs and not draft_blobs & {t["blob"] for t in m["tensors"].values()}
    assert draft_blobs <= set(m["blobs"])
    assert len(draft["prefix_kv"]) == len(m["prefixes"])
    for target_kv, draft_kv in zip(m["prefixes"], draft["prefix_kv"], strict=True):
        assert draft_kv["blob"] in m["blobs"] and draft_kv["shape"][3] == target_kv["shape"][3] > 0


def test_a_mismatched_draft_is_refused_clearly(tiny_model_dir, tmp_path: Path) -> None:
    other = make_random_model(tmp_path / "other", {**FAMILIES["llama"], "vocab_size": 512}, dtype="float32")
    with pytest.raises(BuildError, match="vocabulary"):
        build_snapshot(tiny_model_dir("llama"), BuildOptions(dtype="float32", draft=other), BlobCache(tmp_path / "c"))
    same_vocab = make_random_model(tmp_path / "same", FAMILIES["llama"], dtype="float32", vocab_size_tokenizer=600)
    with pytest.raises(BuildError, match="tokenizer"):
        build_snapshot(tiny_model_dir("llama"), BuildOptions(dtype="float32", draft=same_vocab),
                       BlobCache(tmp_path / "c"))


def test_draft_prefix_kv_is_loaded_and_serving_matches_plain_decoding(snap: dict[str, Any]) -> None:
    store, cache = str(snap["root"] / "store"), snap["root"] / "cache"
    plain = load(REF, store=store, cache=cache, num_kv_blocks=64)
    spec = load(REF, store=store, cache=cache, num_kv_blocks=64, speculative="draft", num_speculative_tokens=3)
    proposer = spec.engine.speculation.proposer
    assert isinstance(proposer, DraftProposer)
    assert len(proposer.valid) == sum(len(p["block_hashes"]) for p in snap["manifest"]["prefixes"])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [DOC_TEXT + " And then", "Once upon a time", DOC_TEXT]
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    stats = spec.engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.spec_num_accepted_tokens > 0


def test_serving_without_a_draft_in_the_snapshot_says_what_to_do(tiny_model_dir, tmp_path: Path) -> None:
    built = build_snapshot(tiny_model_dir("llama"), BuildOptions(dtype="float32"), BlobCache(tmp_path / "cache"))
    store = open_store(str(tmp_path / "store"))
    push_snapshot(store, built.manifest.encode(), built.id, built.blob_paths)
    with pytest.raises(SnapshotError, match="--draft"):
        load(built.id, store=str(tmp_path / "store"), cache=tmp_path / "cache", num_kv_blocks=16,
             speculative="draft")


def test_metrics_status_and_the_per_request_switch(client: TestClient) -> None:
    before = client.get("/metrics").text
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "spec_decode_num_emitted_tokens_total",
                 "spec_decode_draft_acceptance_rate"):
        assert f"warmstart:{name}" in before, name
    off = client.post("/v1/completions", json={"model": REF, "prompt": "Once upon a time", "speculative": False,
                                               **GREEDY})
    assert off.status_code == 200
    assert metric(client.get("/metrics").text, "spec_decode_num_drafts_total") == metric(
        before, "spec_decode_num_drafts_total")
    on = client.post("/v1/completions", json={"model": REF, "prompt": "Once upon a time", **GREEDY})
    assert on.json()["choices"][0]["text"] == off.json()["choices"][0]["text"]
    after = client.get("/metrics").text
    drafted = metric(after, "spec_decode_num_draft_tokens_total")
    accepted = metric(after, "spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and metric(after, "spec_decode_draft_acceptance_rate") == pytest.approx(accepted / drafted)
    status = client.get("/status").json()
    assert status["engine"]["speculative"] == "draft" and status["engine"]["num_speculative_tokens"] == 3
    spec = status["speculative"]
    assert spec["num_draft_tokens"] == drafted and spec["num_accepted_tokens"] == accepted
    bad = client.post("/v1/completions", json={"model": REF, "prompt": "x", "speculative": "no", **GREEDY})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative"


def test_serve_and_build_take_the_speculative_options() -> None:
    args = build_parser().parse_args(["serve", "ref", "--speculative", "ngram", "--num-speculative-tokens", "5"])
    assert (args.speculative, args.num_speculative_tokens) == ("ngram", 5)
    args = build_parser().parse_args(["build", "m", "--draft", "d", "--draft-quant", "int4"])
    assert (str(args.draft), args.draft_quant) == ("d", "int4")
    bad = subprocess.run([*WARMSTART, "serve", "ref", "--speculative", "medusa"],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], timeout=60)
    assert bad.returncode == 2 and "--speculative" in bad.stderr


def test_streamed_text_and_logprobs_equal_the_whole_answer(client: TestClient) -> None:
    """Several tokens per step arrive as one chunk; the stream must still add up to the whole answer."""
    body = {"model": REF, "messages": [{"role": "user", "content": DOC_TEXT}], "logprobs": True,
            "top_logprobs": 2, **GREEDY}
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    streamed = client.post("/v1/chat/completions", json={**body, "stream": True})
    events = [json.loads(line[len("data: "):]) for line in streamed.text.split("\n\n")
              if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    tokens = [t["token"] for e in events if e["choices"] and e["choices"][0]["logprobs"]
              for t in e["choices"][0]["logprobs"]["content"]]
    assert text == whole["message"]["content"]
    assert tokens == [t["token"] for t in whole["logprobs"]["content"]]


def test_build_draft_from_the_command_line(tiny_model_dir, tmp_path: Path) -> None:
    model = tiny_model_dir("llama")
    draft = perturb_model(model, tmp_path / "draft", 0.01)
    env = {**os.environ, "WARMSTART_STORE": str(tmp_path / "store"), "WARMSTART_CACHE": str(tmp_path / "cache"),
           "OMP_NUM_THREADS": "1"}

    def warmstart(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*WARMSTART, *args], capture_output=True, text=True,
                              env=env, timeout=300, cwd=Path(__file__).resolve().parents[2])

    built = warmstart("build", str(model), "--draft", str(draft), "--draft-quant", "int8", "--dtype", "float32",
                      "--json")
    assert built.returncode == 0, built.stderr
    sid = json.loads(built.stdout.strip().splitlines()[-1])["id"]
    info = json.loads(warmstart("inspect", sid, "--json").stdout.strip().splitlines()[-1])
    assert info["draft"]["quantization"]["scheme"] == "int8" and info["draft"]["bytes"] > 0
    other = make_random_model(tmp_path / "other", {**FAMILIES["llama"], "vocab_size": 512}, dtype="float32")
    refused = warmstart("build", str(model), "--draft", str(other), "--dtype", "float32")
    assert refused.returncode == 1 and "vocabulary" in refused.stderr and "Traceback" not in refused.stderr
