"""The engine forced onto the Triton kernels (WARMSTART_KERNELS=triton, TRITON_INTERPRET=1) generates what
transformers generates, for every model family: the proof of the CUDA path's wiring without a GPU.

The engine runs in a subprocess because Triton must see TRITON_INTERPRET before its first import; the
reference runs here. Few prompts and tokens: every kernel launch is interpreted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.model_configs import FAMILIES
from tests.support.reference import assert_matches_reference

pytestmark = pytest.mark.kernels

MAX_TOKENS = 4
ROOT = Path(__file__).resolve().parents[2]

# Blocks of 8 and 16 tokens a step: the 30-token prompt is prefilled in chunks over its cached start, decode
# and prefill share steps, and the longest sequence outgrows mistral's window of 24. One process runs every
# family (Triton's import and the interpreter's start are paid once).
ENGINE = """
import json, sys
from warmstart.runtime import LLM, SamplingParams
jobs, max_tokens = json.loads(sys.argv[1]), int(sys.argv[2])
params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
results = {}
for family, (model_dir, prompts) in jobs.items():
    llm = LLM.from_hf(model_dir, dtype="float32", block_size=8, num_kv_blocks=64, max_num_batched_tokens=16)
    outs = llm.generate(prompts, params)
    results[family] = {"ops": llm.engine.runner.model.ops.name, "outs": [o.token_ids for o in outs]}
print(json.dumps(results))
"""


def prompts(vocab: int) -> list[list[int]]:
    shared = [(7 * i + 3) % vocab for i in range(17)]
    return [[5, 6, 7, 8, 9], [(11 * i + 5) % vocab for i in range(30)], shared + [1], shared + [4, 2]]


@pytest.fixture(scope="module")
def engine_on_kernels(tiny_model_dir) -> dict:  # type: ignore[no-untyped-def]
    jobs = {f: (str(tiny_model_dir(f)), prompts(FAMILIES[f]["vocab_size"])) for f in sorted(FAMILIES)}
    env = {**os.environ, "WARMSTART_KERNELS": "triton", "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", ENGINE, json.dumps(jobs), str(MAX_TOKENS)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_engine_on_triton_kernels_matches_transformers(tiny_model_dir, engine_on_kernels, family: str) -> None:  # type: ignore[no-untyped-def]
    result = engine_on_kernels[family]
    assert result["ops"] == "triton"
    model_dir = tiny_model_dir(family)
    for prompt, out in zip(prompts(FAMILIES[family]["vocab_size"]), result["outs"], strict=True):
        assert_matches_reference(model_dir, prompt, out, MAX_TOKENS)


def test_kernels_on_the_cpu_need_the_interpreter() -> None:
    code = "import torch; from warmstart.runtime.layers.ops import select_ops; select_ops(torch.device('cpu'))"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(WARMSTART_KERNELS="triton", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and "also set TRITON_INTERPRET=1" in done.stderr


def test_unknown_kernels_choice_is_refused(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import torch

    from warmstart.runtime.layers.ops import select_ops

    monkeypatch.setenv("WARMSTART_KERNELS", "cuda")
    with pytest.raises(ValueError, match="WARMSTART_KERNELS='cuda' is not one of torch, triton"):
        select_ops(torch.device("cpu"))
    monkeypatch.delenv("WARMSTART_KERNELS")
    assert select_ops(torch.device("cpu")).name == "torch"
