"""generation_config.json read as vLLM's --generation-config auto reads it; a bad one is refused naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from warmstart.runtime.generation_config import GenerationConfigError, GenerationDefaults


def test_extra_eos_ids_and_recommended_sampling_are_read() -> None:
    raw = {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "do_sample": True,
           "temperature": 0.6, "top_p": 0.9, "top_k": 20, "transformers_version": "4.45.0"}
    d = GenerationDefaults.from_dict(raw)
    assert d.eos_token_ids == (128001, 128008, 128009)
    assert d.sampling == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert GenerationDefaults.from_dict({"eos_token_id": 2}).eos_token_ids == (2,)


@pytest.mark.parametrize(("raw", "words"), [
    ({"eos_token_id": "x"}, "eos_token_id"),
    ({"eos_token_id": [1, -2]}, "eos_token_id"),
    ({"top_p": 0}, "top_p"),
    ({"temperature": -1}, "temperature"),
    ({"top_k": 2.5}, "top_k"),
    ([], "JSON object"),
])
def test_a_bad_generation_config_names_the_field(raw: object, words: str) -> None:
    with pytest.raises(GenerationConfigError, match=words):
        GenerationDefaults.from_dict(raw, "gc.json")


def test_the_engine_stops_on_generation_config_eos_ids(tiny_model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from warmstart.runtime import LLM, SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0)
    plain = LLM.from_hf(tiny_model_dir("llama"), dtype="float32", num_kv_blocks=32).generate([[5, 6, 7]], params)[0]
    assert plain.finish_reason == "length"
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama"), model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, plain.token_ids[1]]}))
    out = LLM.from_hf(model, dtype="float32", num_kv_blocks=32).generate([[5, 6, 7]], params)[0]
    stop_at = plain.token_ids.index(plain.token_ids[1])  # its first occurrence
    assert out.finish_reason == "stop" and out.token_ids == plain.token_ids[: stop_at + 1]


def test_build_refuses_a_bad_generation_config(tiny_model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from warmstart.snapshot.build import BuildError, BuildOptions, build_snapshot
    from warmstart.snapshot.cache import BlobCache

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama"), model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "top_p": 7}))
    with pytest.raises(BuildError, match="top_p 7 is out of range"):
        build_snapshot(model, BuildOptions(dtype="float32"), BlobCache(tmp_path / "cache"))
