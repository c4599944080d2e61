"""A Mixture-of-Experts model served and answered through the official openai client: `warmstart serve DIR` on a
random Mixtral and a Qwen3-MoE (built into the store, then served), the replies equal to the engine's own, which
the engine tests hold equal to transformers."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.support.serving import KEY, ServerProcess, TinySnapshot
from warmstart.runtime import LLM, SamplingParams


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_moe_model_answers_through_the_openai_client(tiny_model_dir, tmp_path: Path, family: str) -> None:  # type: ignore[no-untyped-def]
    model_dir = tiny_model_dir(family)
    place = TinySnapshot("", tmp_path / "store", tmp_path / "cache", {})
    server = ServerProcess(place, "--num-kv-blocks", "64", "--max-model-len", "256", ref=str(model_dir))
    prompt = [5, 6, 7, 8, 9, 10, 11]
    try:
        server.wait_for("ready")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        completion = client.completions.create(model=str(model_dir), prompt=prompt, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True})  # fmt: skip
        chat = client.chat.completions.create(model=str(model_dir), max_tokens=6, temperature=0,
                                              messages=[{"role": "user", "content": "Which expert answers?"}])
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model=str(model_dir), max_tokens=6, temperature=0, stream=True,
            messages=[{"role": "user", "content": "Which expert answers?"}]) if chunk.choices)
    finally:
        assert server.stop() == 0
    reference = LLM.from_hf(model_dir, dtype="bfloat16", num_kv_blocks=64).generate(  # what the snapshot stores
        [prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert completion.choices[0].text == reference.text and completion.usage.completion_tokens == 8
    assert chat.choices[0].message.content and chat.choices[0].message.content == streamed
