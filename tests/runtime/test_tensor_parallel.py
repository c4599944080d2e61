"""Tensor parallelism with real processes: 2 gloo ranks (tests/support/tp_worker.py) against the single-rank engine.

One process pair runs every case of the module (each family from its HF directory, preemption, a sharded
snapshot with a prefix, and finally a follower that dies), so the module costs one group's start-up.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support.model_configs import FAMILIES
from warmstart.runtime.engine.engine import LLMEngine
from warmstart.runtime.engine.options import EngineOptions
from warmstart.runtime.engine.tensor_parallel import TensorParallelError, shard_config
from warmstart.runtime.models.config import ModelConfig
from warmstart.runtime.sampling_params import SamplingParams
from warmstart.snapshot.adapters import AdapterSpec
from warmstart.snapshot.build import BuildError, BuildOptions, PrefixSpec, build_snapshot
from warmstart.snapshot.cache import BlobCache
from warmstart.snapshot.loader import SnapshotError, load_with_report
from warmstart.snapshot.stores import open_store
from warmstart.snapshot.transfer import push_snapshot

REPO = Path(__file__).resolve().parents[2]
WORLD = 2
FAMILY_OPTIONS = {"num_kv_blocks": 64, "max_num_batched_tokens": 32}  # chunked prefills beside decodes
PREEMPT_OPTIONS = {"block_size": 4, "num_kv_blocks": 14, "max_num_seqs": 4}
DOC_TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire. " * 3


def prompts_for(family: str, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = FAMILIES[family]["vocab_size"]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def single_rank(model_dir: Path, case: dict[str, Any], engine: LLMEngine | None = None) -> list[list[int]]:
    engine = engine or LLMEngine.from_hf(model_dir, EngineOptions(dtype="float32", **case.get("options", {})))
    params = SamplingParams(max_tokens=case["max_tokens"], temperature=0.0, ignore_eos=True)
    adapters = case.get("adapters") or [None] * len(case["prompts"])
    for i, (prompt, adapter) in enumerate(zip(case["prompts"], adapters, strict=True)):
        engine.add_request(prompt, params, request_id=str(i), adapter=adapter)
    tokens = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
    return [tokens[str(i)] for i in range(len(case["prompts"]))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def sharded_snapshot(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:  # type: ignore[no-untyped-def]
    """The llama model with a text prefix and two PEFT adapters (5 virtual tokens: a partial block that each
    request copies; 16: whole blocks), built for 2 ranks, and the same built for 1 as the reference."""
    from tests.support.peft_reference import make_adapter

    root = tmp_path_factory.mktemp("tp-snapshot")
    model_dir = tiny_model_dir("llama")
    (root / "doc.txt").write_text(DOC_TEXT)
    adapters = [AdapterSpec("prompt", make_adapter(model_dir, root / "prompt", "PromptTuningConfig", seed=0,
                                                   num_virtual_tokens=5)),
                AdapterSpec("prefix", make_adapter(model_dir, root / "prefix", "PrefixTuningConfig", seed=1,
                                                   num_virtual_tokens=16))]
    options = BuildOptions(dtype="float32", prefixes=[PrefixSpec("doc", root / "doc.txt", "text")], adapters=adapters)
    single = build_snapshot(model_dir, options, BlobCache(root / "single-cache"))
    options.tensor_parallel = WORLD
    built = build_snapshot(model_dir, options, BlobCache(root / "build-cache"))
    int8 = BuildOptions(quant="int8", prefixes=options.prefixes)  # bf16: int8 kernels' own dtype
    int8_single = build_snapshot(model_dir, int8, BlobCache(root / "single-cache"))
    int8.tensor_parallel = WORLD
    int8_built = build_snapshot(model_dir, int8, BlobCache(root / "build-cache"))
    store = open_store(str(root / "store"))
    for b in (built, int8_built):
        push_snapshot(store, b.manifest.encode(), b.id, b.blob_paths)
    return SimpleNamespace(id=built.id, store=str(root / "store"), root=root, manifest=built.manifest,
                           single=single, int8_id=int8_built.id, int8_single=int8_single)


# OLMo 2's q/k norms span every head, so its ranks cannot each hold only theirs, and experts do not split yet: they
# are refused (a test below)
SHARDED_FAMILIES = [f for f in FAMILIES if f not in ("olmo2", "qwen3_moe", "mixtral")]


@pytest.fixture(scope="module")
def cases(tiny_model_dir, sharded_snapshot) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    out: list[dict[str, Any]] = [
        {"family": f, "model_dir": str(tiny_model_dir(f)), "prompts": prompts_for(f, [5, 21, 45]), "max_tokens": 6,
         "options": FAMILY_OPTIONS} for f in SHARDED_FAMILIES
    ]
    out.append({"family": "llama", "name": "preemption", "model_dir": str(tiny_model_dir("llama")),
                "prompts": prompts_for("llama", [10, 11, 9, 10], seed=1), "max_tokens": 12,
                "options": PREEMPT_OPTIONS})
    out.append({"family": "qwen2", "name": "whole_head", "split_head": False, "model_dir": str(tiny_model_dir("qwen2")),
                "prompts": prompts_for("qwen2", [5, 30]), "max_tokens": 6, "options": FAMILY_OPTIONS})
    prefix = list(sharded_snapshot.manifest.data["prefixes"][0]["token_ids"])
    out.append({"family": "llama", "name": "snapshot", "snapshot": sharded_snapshot.id,
                "store": sharded_snapshot.store, "cache": str(sharded_snapshot.root / "cache-{rank}"),
                "prompts": [prefix + p for p in prompts_for("llama", [4, 9], seed=2)] + prompts_for("llama", [6, 20]),
                "adapters": [None, None, "prompt", "prefix"], "max_tokens": 6, "options": {"num_kv_blocks": 64}})
    out.append({"family": "llama", "name": "int8", "snapshot": sharded_snapshot.int8_id,
                "store": sharded_snapshot.store, "cache": str(sharded_snapshot.root / "cache-int8-{rank}"),
                "prompts": [prefix + p for p in prompts_for("llama", [3, 12], seed=4)], "max_tokens": 6,
                "options": {"num_kv_blocks": 64}})
    out.append({"family": "llama", "name": "follower_dies", "follower_dies": True,
                "model_dir": str(tiny_model_dir("llama")), "prompts": prompts_for("llama", [7]), "max_tokens": 4,
                "options": {"num_kv_blocks": 16}})
    return out


@pytest.fixture(scope="module")
def results(cases: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("tp-run")
    spec = {"cases": cases, "out": str(root / "out.json"), "timeout_s": 30}
    (root / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(WORLD),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.support.tp_worker", str(root / "spec.json")], cwd=REPO,
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]
    try:
        logs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode == 0, logs[0][-3000:]
    assert procs[1].returncode == 3, logs[1][-3000:]  # the follower that dies on purpose, in the last case
    return json.loads((root / "out.json").read_text())  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", SHARDED_FAMILIES)
def test_greedy_output_equals_single_rank(family: str, cases, results) -> None:  # type: ignore[no-untyped-def]
    i = next(i for i, c in enumerate(cases) if c["family"] == family and "name" not in c)
    case, got = cases[i], results[i]
    assert got["tokens"] == single_rank(Path(case["model_dir"]), case)
    config = ModelConfig.from_dir(case["model_dir"])
    assert got["kv_heads"] == config.num_kv_heads // WORLD  # each rank's pool holds only its own KV heads
    assert got["steps"] > 0 and got["gather_seconds"] > 0  # the head is split by vocabulary


def test_head_computed_whole_by_rank_0(cases, results) -> None:  # type: ignore[no-untyped-def]
    i = next(i for i, c in enumerate(cases) if c.get("name") == "whole_head")
    assert results[i]["gather_seconds"] == 0
    assert results[i]["tokens"] == single_rank(Path(cases[i]["model_dir"]), cases[i])


def test_preemption_under_tensor_parallelism(cases, results) -> None:  # type: ignore[no-untyped-def]
    i = next(i for i, c in enumerate(cases) if c.get("name") == "preemption")
    assert results[i]["preemptions"] > 0
    assert results[i]["tokens"] == single_rank(Path(cases[i]["model_dir"]), cases[i])


def test_prefix_hits_and_adapters_from_a_sharded_snapshot(cases, results, sharded_snapshot, tmp_path) -> None:  # type: ignore[no-untyped-def]
    i = next(i for i, c in enumerate(cases) if c.get("name") == "snapshot")
    got = results[i]
    prefix_blocks = len(sharded_snapshot.manifest.data["prefixes"][0]["block_hashes"])
    assert prefix_blocks > 0 and got["cached_tokens"][:2] == [prefix_blocks * 16] * 2
    reference, _ = load_with_report(sharded_snapshot.single.id, None, sharded_snapshot.root / "single-cache",
                                    **cases[i]["options"])
    assert got["tokens"] == single_rank(Path(), cases[i], reference.engine)
    # Each rank pulled its own blobs only: together more than the shared part, each less than the whole.
    total = sum(sharded_snapshot.manifest.blob_sizes().values())
    pulled = [load["bytes_downloaded"] for load in got["loads"]]
    assert all(0 < p < total for p in pulled)
    assert pulled == [sum(sharded_snapshot.manifest.blob_sizes(r).values()) for r in range(WORLD)]


def test_int8_weights_split_exactly(cases, results, sharded_snapshot) -> None:  # type: ignore[no-untyped-def]
    """int8 scales are per output channel, so each rank's shard is the int8 of its part: same greedy output."""
    i = next(i for i, c in enumerate(cases) if c.get("name") == "int8")
    assert results[i]["cached_tokens"][0] > 0
    reference, _ = load_with_report(sharded_snapshot.int8_single.id, None, sharded_snapshot.root / "single-cache",
                                    **cases[i]["options"])
    assert results[i]["tokens"] == single_rank(Path(), cases[i], reference.engine)


def test_a_dead_follower_fails_the_step_instead_of_hanging(cases, results) -> None:  # type: ignore[no-untyped-def]
    assert len(results) == len(cases)
    last = results[-1]
    assert last["error"] is not None and last["seconds"] < 20, last


def test_snapshot_for_two_ranks_refuses_one(sharded_snapshot, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SnapshotError, match="tensor parallelism 2 .* --tensor-parallel 2.*--tensor-parallel 1"):
        load_with_report(sharded_snapshot.id, sharded_snapshot.store, tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("blobs/*"))  # refused before pulling anything


def test_unsharded_snapshot_refuses_two_ranks(tiny_model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    built = build_snapshot(tiny_model_dir("qwen3"), BuildOptions(dtype="float32"), BlobCache(tmp_path / "c"))
    two_ranks = SimpleNamespace(rank=0, world=2)
    with pytest.raises(SnapshotError, match="built for tensor parallelism 1 .*--tensor-parallel 2"):
        load_with_report(built.id, None, tmp_path / "c", group=two_ranks)  # type: ignore[arg-type]


def test_heads_that_do_not_divide_are_refused(tiny_model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = ModelConfig.from_dir(tiny_model_dir("qwen2"))  # 6 heads, 2 KV heads
    with pytest.raises(TensorParallelError, match="num_key_value_heads=2.*use --tensor-parallel 1 or 2"):
        shard_config(config, 4)
    with pytest.raises(BuildError, match="num_key_value_heads=2"):
        build_snapshot(tiny_model_dir("qwen2"), BuildOptions(dtype="float32", tensor_parallel=3),
                       BlobCache(tmp_path / "c"))
    with pytest.raises(TensorParallelError, match="Olmo2ForCausalLM's q/k norms span all heads.*--tensor-parallel 1"):
        shard_config(ModelConfig.from_dir(tiny_model_dir("olmo2")), 2)
    with pytest.raises(TensorParallelError, match="MixtralForCausalLM's experts do not split.*--tensor-parallel 1"):
        shard_config(ModelConfig.from_dir(tiny_model_dir("mixtral")), 2)
    with pytest.raises(BuildError, match="q/k norms span all heads"):
        build_snapshot(tiny_model_dir("olmo2"), BuildOptions(dtype="float32", tensor_parallel=2),
                       BlobCache(tmp_path / "c"))
    with pytest.raises(BuildError, match="--quant int4's groups span the split"):
        build_snapshot(tiny_model_dir("qwen2"), BuildOptions(quant="int4", tensor_parallel=2),
                       BlobCache(tmp_path / "c"))
