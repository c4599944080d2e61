"""POST /v1/embeddings through a real `warmstart serve` and the official openai client: each input's final hidden
states pooled (last token, or mean with --embedding-pooling mean) and L2-normalized, equal to transformers'
AutoModel on the same tokens, as base64 (the client's default) and as floats; what cannot be served is a 400."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from tests.support.serving import KEY, REF, ServerProcess, TinySnapshot, build_tiny_snapshot, ready_side_by_side
from warmstart.runtime import LLM

TEXTS = ["The quick brown fox", "jumps over the lazy dog while the cat sleeps by the warm fire", "Hi"]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:  # type: ignore[no-untyped-def]
    return tiny_model_dir("llama")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def snap(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TinySnapshot:
    return build_tiny_snapshot(model_dir, tmp_path_factory.mktemp("embeddings"))


@pytest.fixture(scope="module")
def servers(snap: TinySnapshot) -> Iterator[dict[str, ServerProcess]]:
    with ready_side_by_side({pooling: ServerProcess(snap, "--num-kv-blocks", "64", "--max-model-len", "256",
                                                    "--embedding-pooling", pooling)
                             for pooling in ("last", "mean")}) as started:
        yield started


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def reference(model_dir: Path, texts: list[str], pooling: str) -> list[torch.Tensor]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32)
    out = []
    for text in texts:
        with torch.no_grad():
            hidden = model(torch.tensor([tokenizer(text)["input_ids"]])).last_hidden_state[0]
        out.append(torch.nn.functional.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=-1))
    return out


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers_pooled_hidden_states(servers: dict[str, ServerProcess], model_dir: Path,
                                                             pooling: str) -> None:
    expected = reference(model_dir, TEXTS, pooling)
    as_base64 = client(servers[pooling]).embeddings.create(model=REF, input=TEXTS)  # the client asks for base64
    as_floats = client(servers[pooling]).embeddings.create(model=REF, input=TEXTS, encoding_format="float")
    for reply in (as_base64, as_floats):
        assert [d.index for d in reply.data] == [0, 1, 2] and reply.model == REF
        for item, want in zip(reply.data, expected, strict=True):
            got = torch.tensor(item.embedding)
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert as_floats.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)


def test_token_ids_are_embedded_as_the_offline_face_embeds_them(servers: dict[str, ServerProcess],
                                                                model_dir: Path) -> None:
    ids = [[5, 6, 7, 8, 9], [11]]
    reply = client(servers["last"]).embeddings.create(model=REF, input=ids, encoding_format="float")
    offline = LLM.from_hf(model_dir, dtype="float32", num_kv_blocks=16).embed(ids)
    for item, want in zip(reply.data, offline, strict=True):
        assert torch.allclose(torch.tensor(item.embedding), want, atol=1e-5)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"input": ""}, "input is required"),
    ({"input": ["ok", ""]}, "input[1] is empty"),
    ({"input": [[5, 6, 10**9]]}, "must be a token id"),
    ({"input": [list(range(3, 300))]}, "more than this model's context of 256"),
    ({"input": "hi", "dimensions": 7}, "leave dimensions out"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format must be float or base64"),
])
def test_what_cannot_be_served_is_a_400_naming_it(servers: dict[str, ServerProcess], kwargs: dict[str, object],
                                                  message: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(servers["last"]).embeddings.create(model=REF, **kwargs)  # type: ignore[arg-type]
    assert message in caught.value.message
