"""Adapters over HTTP: named by "adapter" or "model": "BASE:NAME", listed in /v1/models, /status and
`warmstart inspect`, chosen by "auto" as accurately as the build measured, refused by name with a 4xx that
lists the known ones; once in-process (TestClient) and once through a real `warmstart serve`."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from tests.support.cli import last_json, warmstart
from tests.support.peft_reference import make_adapter
from tests.support.serving import AUTH, KEY, ServerProcess, TinySnapshot, error_of, ready_state
from warmstart.handlers.openai.requests import APIError, ServedModel, parse_completion
from warmstart.handlers.server.app import create_app
from warmstart.handlers.server.metrics import Metrics
from warmstart.handlers.server.state import ServeState
from warmstart.handlers.server.timeline import cold_start_timeline
from warmstart.runtime import LLM, SamplingParams
from warmstart.snapshot.loader import load

TOPICS = {
    "cooking": "salt pepper oven bake flour sugar butter onion garlic soup bread dinner",
    "finance": "money bank loan price market stock trade tax budget cash invest profit",
    "travel": "train plane hotel ticket beach city map road trip airport luggage mountain",
}
COMMON = ["the", "a", "what", "how", "please", "tell", "me", "about", "my"]
ADAPTERS = {"cooking": ("PromptTuningConfig", {"num_virtual_tokens": 5}),
            "finance": ("PrefixTuningConfig", {"num_virtual_tokens": 20}),
            "travel": ("PromptEncoderConfig", {"num_virtual_tokens": 7, "encoder_hidden_size": 16})}


def query(topic: str, rng: random.Random) -> str:
    words = rng.sample(TOPICS[topic].split(), 4) + rng.sample(COMMON, 3)
    rng.shuffle(words)
    return " ".join(words)


@pytest.fixture(scope="module")
def snap(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> TinySnapshot:  # type: ignore[no-untyped-def]
    """The tiny llama with three adapters of three types and 30 example queries each, built by the CLI."""
    root = tmp_path_factory.mktemp("adapters-serve")
    model_dir = tiny_model_dir("llama")
    rng = random.Random(0)
    args = []
    for i, (name, (kind, opts)) in enumerate(ADAPTERS.items()):
        make_adapter(model_dir, root / name, kind, seed=i, **opts)
        (root / f"{name}.txt").write_text("\n".join(query(name, rng) for _ in range(30)))
        args += ["--adapter", f"{name}={root / name}", "--adapter-examples", f"{name}={root / name}.txt"]
    env = {"WARMSTART_STORE": str(root / "store"), "WARMSTART_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "1"}
    built = last_json(warmstart("build", str(model_dir), "--dtype", "float32", "--tag", "tiny", "--json", *args,
                                env={**os.environ, **env}))
    assert [a["name"] for a in built["adapters"]] == sorted(ADAPTERS)
    return TinySnapshot(built["id"], root / "store", root / "cache", {})


@pytest.fixture(scope="module")
def state(snap: TinySnapshot) -> Iterator[ServeState]:
    s = ready_state(snap)
    yield s
    s.shutdown()


@pytest.fixture(scope="module")
def client(state: ServeState) -> Iterator[TestClient]:
    with TestClient(create_app(state)) as c:
        yield c


@pytest.fixture(scope="module")
def reference(snap: TinySnapshot) -> LLM:
    return load(snap.id, store=str(snap.store), cache=snap.cache, num_kv_blocks=64, prepack_weights=False)


def completion(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True, **extra}


def test_models_status_and_inspect_list_the_adapters(client: TestClient, snap: TinySnapshot) -> None:
    models = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny", "cooking", "finance", "travel"]  # vLLM's LoRA entries
    assert all(m["parent"] == "tiny" for m in models[1:]) and models[2]["virtual_tokens"] == 20
    status = client.get("/status").json()
    assert {a["name"]: (a["virtual_tokens"], a["wasted_slots"]) for a in status["adapters"]} == {
        "cooking": (5, 11), "finance": (20, 12), "travel": (7, 9)}
    assert status["adapter_selector"]["held_out"] == 18 and status["adapter_selector"]["accuracy"] >= 0.9
    env = {**os.environ, "WARMSTART_STORE": str(snap.store), "WARMSTART_CACHE": str(snap.cache)}
    info = last_json(warmstart("inspect", "tiny", "--json", env=env))
    assert info["adapters"] == status["adapters"] and info["selector"] == status["adapter_selector"]
    text = warmstart("inspect", "tiny", env=env).stdout
    assert "adapter finance (PREFIX_TUNING): 20 virtual tokens, 12 KV slots of padding" in text


@pytest.mark.parametrize("how", ["adapter", "model", "bare"])
def test_a_request_names_its_adapter(client: TestClient, reference: LLM, how: str) -> None:
    prompt = [5, 17, 99, 4, 250, 31]
    named = {"adapter": {"adapter": "finance"}, "model": {"model": "tiny:finance"}, "bare": {"model": "finance"}}[how]
    body = client.post("/v1/completions", json=completion(prompt, **named)).json()
    want = reference.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                              adapter="finance")[0]
    base = reference.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert body["adapter"] == "finance" and body["model"] == {"bare": "finance"}.get(how, "tiny:finance")  # as sent
    assert body["choices"][0]["text"] == want.text != base.text
    assert body["usage"]["prompt_tokens"] == len(prompt)  # the virtual tokens are not the user's


def test_metrics_show_the_adapters_in_use(reference: LLM) -> None:
    engine = reference.engine
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id="m1", adapter="travel")
    engine.add_request([5, 6, 8], SamplingParams(max_tokens=2), request_id="m2", adapter="cooking")
    try:
        text = Metrics("tiny", cold_start_timeline()).render(engine.stats()).decode()
    finally:
        engine.abort("m1")
        engine.abort("m2")
    line = next(x for x in text.splitlines() if x.startswith("warmstart:lora_requests_info{"))
    assert 'max_lora="3"' in line and 'waiting_lora_adapters="cooking,travel"' in line
    assert 'running_lora_adapters=""' in line


def test_the_adapter_field_streams_and_chats(client: TestClient) -> None:
    whole = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 4, "temperature": 0, "adapter": "travel"}).json()
    assert whole["adapter"] == "travel"
    with client.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 4, "temperature": 0, "adapter": "travel", "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all(c["adapter"] == "travel" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        whole["choices"][0]["message"]["content"]


@pytest.mark.parametrize(("extra", "status", "words"), [
    ({"adapter": "baking"}, 404, "unknown adapter 'baking'; this snapshot's adapters: cooking, finance, travel"),
    ({"model": "tiny:baking"}, 404, "unknown adapter 'baking'; this snapshot's adapters: cooking, finance, travel"),
    ({"model": "other:cooking"}, 404, "model 'other:cooking' is not served here"),
    ({"model": "baking"}, 404, "model 'baking' is not served here; this server serves 'tiny' with adapters cooking, "
                               "finance, travel"),
    ({"model": "cooking", "adapter": "travel"}, 400, "name one"),
    ({"model": "tiny:cooking", "adapter": "travel"}, 400, "name one"),
    ({"adapter": 3}, 400, "adapter"),
])
def test_bad_adapter_names_get_a_4xx_naming_the_known_ones(client: TestClient, extra: dict[str, Any], status: int,
                                                           words: str) -> None:
    r = client.post("/v1/completions", json=completion([5, 6, 7], **extra))
    assert r.status_code == status, r.text
    assert words in error_of(r)["message"]


def test_auto_without_a_selector_and_the_context_with_virtual_tokens() -> None:
    model = ServedModel("m", "0" * 32, None, vocab_size=100, max_model_len=32, kv_cache_tokens=1000,
                        adapters={"long": 20})
    with pytest.raises(APIError, match="needs a snapshot built with --adapter-examples"):
        parse_completion(completion([1, 2], adapter="auto"), model)
    assert parse_completion(completion(list(range(11)), adapter="long", max_tokens=1), model).adapter == "long"
    with pytest.raises(APIError, match="12 tokens behind the 20 virtual tokens of adapter 'long'"):
        parse_completion(completion(list(range(12)), adapter="long", max_tokens=1), model)


def test_auto_routes_unseen_queries_as_accurately_as_the_build_measured(client: TestClient) -> None:
    reported = client.get("/status").json()["adapter_selector"]["accuracy"]
    rng = random.Random(42)  # not the build's examples
    right = 0
    cases = [(topic, query(topic, rng)) for topic in TOPICS for _ in range(8)]
    for i, (topic, text) in enumerate(cases):
        if i % 2:
            body = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}],
                                                             "max_tokens": 1, "adapter": "auto"}).json()
        else:
            body = client.post("/v1/completions", json={"prompt": text, "max_tokens": 1, "adapter": "auto"}).json()
        right += body["adapter"] == topic
    assert right / len(cases) >= min(reported, 0.95) - 0.05, (right, len(cases), reported)


def test_real_server_serves_adapters_over_the_wire(snap: TinySnapshot) -> None:
    server = ServerProcess(snap, "--num-kv-blocks", "64", "--max-model-len", "256")
    try:
        server.wait_for("ready")
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
            models = http.get("/v1/models").json()["data"]
            assert [(m["id"], m.get("parent")) for m in models] == \
                [("tiny", None), ("cooking", "tiny"), ("finance", "tiny"), ("travel", "tiny")]
            body = http.post("/v1/completions", json={"prompt": "bake bread with butter and sugar",
                                                      "max_tokens": 3, "adapter": "auto"}).json()
            assert body["adapter"] == "cooking" and body["model"] == "tiny:cooking"
            r = http.post("/v1/completions", json=completion([1, 2], model="tiny:nope"))
            assert r.status_code == 404 and "cooking, finance, travel" in r.text
        # The official client, naming the adapter by the id /v1/models gave it, as with vLLM's LoRA adapters.
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        prompt = [5, 17, 99, 4, 250, 31]
        bare = client.completions.create(model="finance", prompt=prompt, max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})
        named = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True, "adapter": "finance"})
        base = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert bare.choices[0].text == named.choices[0].text != base.choices[0].text
        # As vLLM, every endpoint reports the model by the name the client sent.
        assert (bare.model, named.model, base.model) == ("finance", "tiny:finance", "tiny")
        chat = client.chat.completions.create(model="finance", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2)
        whole = client.responses.create(model="finance", input="hi", max_output_tokens=2)
        streamed = [e for e in client.responses.create(model="finance", input="hi", max_output_tokens=2, stream=True)
                    if e.type in ("response.created", "response.completed")]
        assert [chat.model, whole.model, *(e.response.model for e in streamed)] == ["finance"] * 4
        assert [m.id for m in client.models.list()] == ["tiny", "cooking", "finance", "travel"]
    finally:
        assert server.stop() == 0


def test_a_served_name_with_a_colon_is_the_base_model() -> None:
    model = ServedModel("llama3:8b", "0" * 32, None, vocab_size=100, max_model_len=32, kv_cache_tokens=1000,
                        adapters={"sql": 4})
    assert parse_completion(completion([1, 2], model="llama3:8b"), model).adapter is None
    assert parse_completion(completion([1, 2], model="sql"), model).adapter == "sql"
    with pytest.raises(APIError, match="'llama3' is not served here"):
        parse_completion(completion([1, 2], model="llama3"), model)
