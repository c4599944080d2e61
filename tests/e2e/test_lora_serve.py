"""LoRA adapters served unmerged through a real `warmstart serve` and the official openai client: two
adapters from the snapshot and the base in one stream of concurrent requests, each equal to the in-process engine's
output, with fewer device slots than adapters (--max-loras 1: requests wait for theirs); an adapter pushed to the
store loaded and unloaded without a restart (vLLM's routes and bodies), its errors, the API key, /v1/models and
the metrics."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.cli import last_json, warmstart
from tests.support.peft_reference import make_adapter
from tests.support.serving import AUTH, KEY, ServerProcess, TinySnapshot, error_of
from warmstart.runtime import LLM, SamplingParams
from warmstart.snapshot.adapters import AdapterSpec
from warmstart.snapshot.cache import BlobCache
from warmstart.snapshot.loader import load
from warmstart.snapshot.lora import fetch_lora, lora_loader, push_lora
from warmstart.snapshot.stores import open_store

LORAS = {"sql": {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]},
         "chat": {"r": 8, "lora_alpha": 8, "use_rslora": True, "target_modules": ["o_proj", "gate_proj", "up_proj"]},
         "math": {"r": 2, "lora_alpha": 4, "target_modules": ["k_proj", "up_proj"]}}
ENGINE = ("--num-kv-blocks", "64", "--max-model-len", "256", "--max-num-seqs", "8")
PROMPTS = [[5, 17, 99, 4, 250, 31], [7, 7, 300, 12], [42, 8, 19, 77, 3, 120, 64], [11, 240, 9]]


@pytest.fixture(scope="module")
def built(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> tuple[TinySnapshot, Path, dict[str, Path]]:  # type: ignore[no-untyped-def]
    """The tiny llama with LoRA adapters sql and chat in the snapshot, and math pushed against it on its own."""
    root = tmp_path_factory.mktemp("lora-serve")
    model_dir = tiny_model_dir("llama")
    dirs = {name: make_adapter(model_dir, root / name, "LoraConfig", seed=10 + i, **opts)
            for i, (name, opts) in enumerate(LORAS.items())}
    env = {**os.environ, "WARMSTART_STORE": str(root / "store"), "WARMSTART_CACHE": str(root / "cache"),
           "OMP_NUM_THREADS": "1"}
    out = last_json(warmstart("build", str(model_dir), "--dtype", "float32", "--tag", "tiny", "--json", "--lora",
                              f"sql={dirs['sql']}", "--lora", f"chat={dirs['chat']}", env=env))
    push_lora(open_store(str(root / "store")), BlobCache(root / "push-cache"), AdapterSpec("math", dirs["math"]),
              out["id"])
    return TinySnapshot(out["id"], root / "store", root / "cache", {}), model_dir, dirs


@pytest.fixture(scope="module")
def server(built: tuple[TinySnapshot, Path, dict[str, Path]]) -> Iterator[ServerProcess]:
    proc = ServerProcess(built[0], *ENGINE, "--max-loras", "1", "--max-lora-rank", "8")
    try:
        proc.wait_for("ready")
        yield proc
    finally:
        assert proc.stop() == 0


@pytest.fixture(scope="module")
def reference(built: tuple[TinySnapshot, Path, dict[str, Path]]) -> LLM:
    snap = built[0]
    return load(snap.id, store=str(snap.store), cache=snap.cache, num_kv_blocks=64, max_model_len=256,
                prepack_weights=False)


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def test_adapters_and_base_mixed_in_one_concurrent_stream_equal_the_in_process_engine(
        server: ServerProcess, reference: LLM) -> None:
    c = client(server)
    names = {"tiny": None, "sql": "sql", "chat": "chat", "tiny:sql": "sql", "adapter=chat": "chat"}
    jobs = [(how, prompt) for prompt in PROMPTS for how in names]  # the ways a request names its adapter

    def send(how: str, prompt: list[int]) -> Any:
        model, extra = ("tiny", {"adapter": how[8:]}) if how.startswith("adapter=") else (how, {})
        return c.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True, **extra})

    with ThreadPoolExecutor(len(jobs)) as pool:  # all at once: one stream, one slot for two adapters
        served = list(pool.map(lambda job: send(*job), jobs))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    adapters = [names[how] for how, _ in jobs]
    want = reference.generate([p for _, p in jobs], params, adapter=adapters)
    assert [s.choices[0].text for s in served] == [w.text for w in want]
    texts = {(a, tuple(job[1])): w.text for job, a, w in zip(jobs, adapters, want, strict=True)}
    for name in ("sql", "chat"):  # the adapters matter
        assert any(texts[(name, tuple(p))] != texts[(None, tuple(p))] for p in PROMPTS)
    assert [s.model for s in served] == [{"adapter=chat": "tiny:chat"}.get(h, h) for h, _ in jobs]  # as vLLM
    assert [m.id for m in c.models.list()][:3] == ["tiny", "sql", "chat"]


def test_load_and_unload_an_adapter_from_the_store_without_a_restart(
        server: ServerProcess, built: tuple[TinySnapshot, Path, dict[str, Path]], reference: LLM,
        tmp_path: Path) -> None:
    snap = built[0]
    cache = BlobCache(tmp_path / "cache")
    entry, size = fetch_lora(open_store(str(snap.store)), cache, snap.id, "math")
    if "math" not in reference.engine.loras.names():
        reference.engine.add_lora("math", lora_loader(entry, cache, size), entry["rank"])
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    want, base = reference.generate([PROMPTS[0]] * 2, params, adapter=["math", None])
    assert want.text != base.text
    c = client(server)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "algebra", "lora_path": "math"})
        assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'algebra' added successfully.")
        models = {m["id"]: m.get("parent") for m in http.get("/v1/models").json()["data"]}
        assert models["algebra"] == models["sql"] == "tiny"
        out = c.completions.create(model="algebra", prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                   extra_body={"ignore_eos": True})
        assert out.choices[0].text == want.text
        again = http.post("/v1/load_lora_adapter", json={"lora_name": "algebra", "lora_path": "math"})
        assert again.status_code == 400
        assert error_of(again)["message"] == "The lora adapter 'algebra' has already been loaded."

        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "algebra"})
        assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'algebra' removed successfully.")
        gone = http.post("/v1/completions", json={"model": "algebra", "prompt": PROMPTS[0], "max_tokens": 1})
        assert gone.status_code == 404 and "algebra" in error_of(gone)["message"]
        assert "algebra" not in {m["id"] for m in http.get("/v1/models").json()["data"]}


@pytest.mark.parametrize(("route", "body", "status", "words"), [
    ("load", {"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
    ("load", {"lora_path": "math"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
    ("load", {"lora_name": "x", "lora_path": "nope"}, 404, "No adapter found for lora_path 'nope'"),
    ("load", {"lora_name": "sql", "lora_path": "math"}, 400, "The lora adapter 'sql' has already been loaded."),
    ("load", {"lora_name": "a b", "lora_path": "math"}, 400, "cannot name an adapter"),
    ("load", {"lora_name": 3, "lora_path": "math"}, 400, "'lora_name' must be a string"),
    ("load", ["lora_name"], 400, "Both 'lora_name' and 'lora_path' must be provided."),
    ("unload", {"lora_name": "nope"}, 404, "The lora adapter 'nope' cannot be found."),
    ("unload", {}, 400, "'lora_name' must be provided."),
])
def test_load_and_unload_errors_are_vllms(server: ServerProcess, route: str, body: Any, status: int,
                                          words: str) -> None:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        r = http.post(f"/v1/{route}_lora_adapter", json=body)
    assert r.status_code == status, r.text
    assert words in error_of(r)["message"]


def test_the_routes_need_the_api_key_and_metrics_count_page_ins(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for route in ("load", "unload"):
            r = http.post(f"/v1/{route}_lora_adapter", json={"lora_name": "x", "lora_path": "math"})
            assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
        wrong = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "math"},
                          headers={"Authorization": "Bearer wrong"})
        assert wrong.status_code == 401
        c = client(server)
        for model in ("sql", "chat", "sql"):  # one slot: every switch pages an adapter in
            c.completions.create(model=model, prompt=PROMPTS[1], max_tokens=1)
        text = http.get("/metrics", headers=AUTH).text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("warmstart:lora_")}
    assert values["warmstart:lora_cache_misses_total"] >= 3
    assert values["warmstart:lora_load_seconds_count"] == values["warmstart:lora_cache_misses_total"]
    assert values["warmstart:lora_load_seconds_sum"] > 0
    info = next(line for line in text.splitlines() if line.startswith("warmstart:lora_requests_info{"))
    assert 'max_lora="1"' in info  # --max-loras 1, no compiled adapters


SECRET = "root:x:0:0:root:/root:/bin/bash\n"  # what a link to /etc/passwd would read


def test_a_pointer_linked_out_of_the_store_or_holding_junk_is_refused_without_its_contents(
        server: ServerProcess, built: tuple[TinySnapshot, Path, dict[str, Path]], tmp_path: Path) -> None:
    """Issue 40, 12: whoever can write the store must not read files through the server's errors."""
    snap = built[0]
    outside = tmp_path / "passwd"
    outside.write_text(SECRET)
    loras = snap.store / "loras"
    (loras / f"{snap.id}.spy").symlink_to(outside)
    (loras / f"{snap.id}.junk").write_text("SECRET-JUNK-TEXT that is no blob id\n")
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        for path, says in (("spy", "is a link that leads out of the store"), ("junk", "does not hold a blob id")):
            r = http.post("/v1/load_lora_adapter", json={"lora_name": f"x-{path}", "lora_path": path})
            message = error_of(r)["message"]
            assert r.status_code == 400 and says in message, message
            assert "root:" not in message and "SECRET" not in message, message


def test_a_stored_adapter_with_nan_weights_is_a_400_naming_the_tensor(
        server: ServerProcess, built: tuple[TinySnapshot, Path, dict[str, Path]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 40, 4: pushed by a writer who skipped the checks (the push itself refuses it: test_lora_weights.py)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from warmstart.runtime.engine import lora as engine_lora

    snap, _, dirs = built
    poisoned = tmp_path / "poison"
    shutil.copytree(dirs["math"], poisoned)
    tensors = load_file(str(poisoned / "adapter_model.safetensors"))
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(poisoned / "adapter_model.safetensors"))
    with monkeypatch.context() as m:
        m.setattr(engine_lora, "_check_finite", lambda *_: None)
        push_lora(open_store(str(snap.store)), BlobCache(tmp_path / "push-cache"), AdapterSpec("poison", poisoned),
                  snap.id)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "poison", "lora_path": "poison"})
        assert r.status_code == 400 and "NaN or infinite values" in error_of(r)["message"], r.text
        assert "poison" not in {m["id"] for m in http.get("/v1/models").json()["data"]}


def _tampered(entry: dict[str, Any], size: int, how: str) -> dict[str, Any]:
    import copy

    bad = copy.deepcopy(entry)
    first = sorted(bad["tensors"])[0]
    place = bad["tensors"][first]
    if how == "bytes too long":
        place["nbytes"] += 4
    elif how == "offset past the data":
        place["offset"] = size
    elif how == "wrong shape":
        place["shape"] = [3, 5, 7]
    elif how == "unknown dtype":
        place["dtype"] = "complex128"
    elif how == "tensors as a list":
        bad["tensors"] = list(bad["tensors"].values())
    return bad


@pytest.mark.parametrize(("how", "says"), [
    ("bytes too long", "bytes, which its shape"), ("offset past the data", "past the end of its"),
    ("wrong shape", "bytes, which its shape"), ("unknown dtype", "the dtype 'complex128'"),
    ("tensors as a list", "has no table of tensors"),
])  # fmt: skip
def test_a_tampered_adapter_record_is_a_400_naming_it(
        server: ServerProcess, built: tuple[TinySnapshot, Path, dict[str, Path]], tmp_path: Path, how: str,
        says: str) -> None:
    """Issue 40, 11: a document pushed by whoever can write the store, describing the math adapter's real blob
    wrongly; each was a 500."""
    from warmstart.snapshot.format import blob_id, encode_lora_document

    snap = built[0]
    store = open_store(str(snap.store))
    entry, size = fetch_lora(store, BlobCache(tmp_path / "cache"), snap.id, "math")
    document = encode_lora_document(snap.id, _tampered(entry, size, how), {entry["blob"]: size})
    (tmp_path / "doc").write_bytes(document)
    store.put_blob(blob_id(document), tmp_path / "doc")
    name = "tampered-" + how.replace(" ", "-")
    store.set_lora(snap.id, name, blob_id(document))
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": name})
    message = error_of(r)["message"]
    assert r.status_code == 400 and says in message and f"LoRA adapter {name!r}" in message, r.text
