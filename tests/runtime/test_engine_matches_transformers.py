"""Greedy output of the batched paged engine equals transformers, request by request, in float32."""

from __future__ import annotations

import pytest

from tests.support.model_configs import FAMILIES
from tests.support.prompts import make_prompts
from tests.support.reference import assert_matches_reference
from warmstart.runtime import LLM, SamplingParams

MAX_TOKENS = 12


def assert_all_match(model_dir, prompts: list[list[int]], outs: list[list[int]]) -> None:  # type: ignore[no-untyped-def]
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_reference(model_dir, prompt, out, MAX_TOKENS)


def run(model_dir, prompts, **options) -> tuple[LLM, list[list[int]]]:  # type: ignore[no-untyped-def]
    llm = LLM.from_hf(model_dir, dtype="float32", **options)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return llm, [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_concurrent_requests_match(tiny_model_dir, family: str) -> None:
    model_dir = tiny_model_dir(family)
    prompts = make_prompts(FAMILIES[family]["vocab_size"])
    _, outs = run(model_dir, prompts, num_kv_blocks=256)
    assert_all_match(model_dir, prompts, outs)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_chunked_prefill_and_preemption_match(tiny_model_dir, family: str) -> None:
    model_dir = tiny_model_dir(family)
    prompts = make_prompts(FAMILIES[family]["vocab_size"])
    # 16 tokens a step forces long prompts into chunks; 14 blocks of 8 cannot hold the batch at once.
    llm, outs = run(model_dir, prompts, block_size=8, num_kv_blocks=14, max_num_batched_tokens=16)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_kv_blocks_used == 0
    assert_all_match(model_dir, prompts, outs)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefix_cache_hits_match(tiny_model_dir, family: str) -> None:
    model_dir = tiny_model_dir(family)
    prompts = make_prompts(FAMILIES[family]["vocab_size"])
    llm = LLM.from_hf(model_dir, dtype="float32", num_kv_blocks=256)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[-4:-3], params)  # the shared prefix is now cached
    outs = llm.generate(prompts[-3:], params)
    assert [o.cached_tokens for o in outs] == [32, 32, 32]
    assert_all_match(model_dir, prompts[-3:], [o.token_ids for o in outs])


def test_sharded_checkpoint_loads_like_a_single_file(tiny_model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from warmstart.runtime.random_model import make_random_model

    sharded = make_random_model(tmp_path / "sharded", FAMILIES["llama"], seed=0, dtype="float32", num_shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    prompts = make_prompts(FAMILIES["llama"]["vocab_size"])[:4]
    _, single_outs = run(tiny_model_dir("llama"), prompts)
    _, sharded_outs = run(sharded, prompts)
    assert sharded_outs == single_outs


def test_split_by_length_groups_every_sequence_once() -> None:
    from warmstart.runtime.engine.model_runner import split_by_length

    widths = [1, 40, 3, 38, 2, 41, 1]
    groups = split_by_length(widths, group_cost=8)
    assert sorted(i for g in groups for i in g) == list(range(len(widths)))
    assert all(g == sorted(g) for g in groups)  # rows keep batch order
    assert len(groups) == 2  # the long three and the short four
    assert split_by_length(widths, group_cost=10**9) == [list(range(len(widths)))]


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_decode_split_into_length_groups_matches(tiny_model_dir, family: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import warmstart.runtime.engine.model_runner as model_runner

    calls: list[int] = []
    split = model_runner.split_by_length

    def counting_split(widths: list[int], group_cost: int) -> list[list[int]]:
        groups = split(widths, group_cost)
        calls.append(len(groups))
        return groups

    monkeypatch.setattr(model_runner, "split_by_length", counting_split)
    monkeypatch.setattr(model_runner, "DECODE_GROUP_COST_BLOCKS", 2)
    monkeypatch.setenv("WARMSTART_CPU_ATTENTION", "torch")  # length groups serve the gather path only
    model_dir = tiny_model_dir(family)
    prompts = make_prompts(FAMILIES[family]["vocab_size"])
    _, outs = run(model_dir, prompts, block_size=8, num_kv_blocks=256)
    assert max(calls) > 1
    assert_all_match(model_dir, prompts, outs)



def test_olmo2_norm_and_rotary_round_as_transformers_in_bfloat16(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """OLMo 2 keeps more in float32 than Llama: its norms multiply their weight before rounding, its rotary runs in
    float32 tables. In bfloat16 ours equal transformers' modules bit for bit (the whole model then differs only
    by the order of the matmuls' sums, which the next test bounds)."""
    import torch
    from transformers.models.olmo2 import modeling_olmo2 as olmo2

    from warmstart.runtime.models.config import ModelConfig
    from warmstart.runtime.models.model import Model
    from warmstart.runtime.models.weights import load_weights
    from warmstart.runtime.random_model import make_random_model

    config = ModelConfig.from_dict(FAMILIES["olmo2"])
    model_dir = make_random_model(tmp_path, FAMILIES["olmo2"], seed=0, dtype="bfloat16")
    model = Model(config, load_weights(model_dir, config, torch.bfloat16), max_positions=1024)

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 256, generator=gen) * 3).bfloat16()  # hidden 256 differs from the model's: norm is per call
    norm = olmo2.Olmo2RMSNorm(256, eps=config.rms_norm_eps).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(256, generator=gen))
        assert torch.equal(model.norm(x, norm.weight), norm(x))

    hf_config = olmo2.Olmo2Config(**{k: v for k, v in FAMILIES["olmo2"].items() if k != "architectures"})
    positions = torch.tensor([0, 3, 17, 500])
    cos, sin = olmo2.Olmo2RotaryEmbedding(hf_config)(x, positions[None])
    q = torch.randn(4, config.num_heads, config.head_dim, generator=gen).bfloat16()
    k = torch.randn(4, config.num_kv_heads, config.head_dim, generator=gen).bfloat16()
    want_q, want_k = olmo2.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = model.rotate(q, k, model.rotary.lookup(positions))
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))


def test_olmo2_in_bfloat16_drifts_from_float32_as_transformers_does(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The whole OLMo 2 model in bfloat16: our last-position logits are no further from transformers' float32 ones
    than 1.5 times transformers' own bfloat16 logits are (benchmarks/bf16_drift.py's criterion)."""
    import torch
    from transformers import AutoModelForCausalLM

    from warmstart.runtime.engine.model_runner import Chunk
    from warmstart.runtime.random_model import make_random_model

    config = {**FAMILIES["olmo2"], "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
              "num_key_value_heads": 4, "num_hidden_layers": 4}
    model_dir = make_random_model(tmp_path / "olmo2", config, seed=0, dtype="bfloat16")
    prompts = [p[:60] for p in make_prompts(config["vocab_size"])[-3:]]

    def transformers_logits(dtype: torch.dtype) -> list[torch.Tensor]:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        with torch.no_grad():
            return [model(torch.tensor([p])).logits[0, -1].float() for p in prompts]

    engine = LLM.from_hf(model_dir, dtype="bfloat16", num_kv_blocks=8, block_size=16, prepack_weights=False).engine
    ours = [engine.runner.forward([Chunk(list(range(4)), p, 0, 1)])[0].float() for p in prompts]
    reference, theirs = transformers_logits(torch.float32), transformers_logits(torch.bfloat16)
    for r, t, o in zip(reference, theirs, ours, strict=True):
        assert (o - r).abs().max() < 1.5 * (t - r).abs().max()


def test_gemma3_norm_and_geglu_round_as_transformers_in_bfloat16(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Gemma's RMSNorm multiplies 1 + its weight in float32 and rounds once; its MLP gates with tanh-approximated
    gelu: in bfloat16 ours equal transformers' modules bit for bit."""
    import torch
    from transformers.models.gemma3 import modeling_gemma3 as gemma3

    from warmstart.runtime.models.config import ModelConfig
    from warmstart.runtime.models.model import Model, gelu_tanh_and_mul
    from warmstart.runtime.models.weights import load_weights
    from warmstart.runtime.random_model import make_random_model

    config = ModelConfig.from_dict(FAMILIES["gemma3"])
    model_dir = make_random_model(tmp_path, FAMILIES["gemma3"], seed=0, dtype="bfloat16")
    model = Model(config, load_weights(model_dir, config, torch.bfloat16), max_positions=1024)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 64, generator=gen) * 3).bfloat16()
    norm = gemma3.Gemma3RMSNorm(64, eps=config.rms_norm_eps).bfloat16()
    hf_config = gemma3.Gemma3TextConfig(**{k: v for k, v in FAMILIES["gemma3"].items() if k != "architectures"})
    mlp = gemma3.Gemma3MLP(hf_config).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(0.1 * torch.randn(64, generator=gen))
        assert torch.equal(model.norm(x, norm.weight), norm(x))
        gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
        assert torch.equal(mlp.down_proj(gelu_tanh_and_mul(gate_up)), mlp(x))


def test_gemma2_logits_are_soft_capped_as_transformers(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """Greedy tokens cannot see the final soft-capping (tanh keeps the order): the logits themselves, in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    from warmstart.runtime.engine.model_runner import Chunk

    model_dir = tiny_model_dir("gemma2")
    prompts = [p for p in make_prompts(FAMILIES["gemma2"]["vocab_size"]) if 20 < len(p) < 64][:3]
    engine = LLM.from_hf(model_dir, dtype="float32", num_kv_blocks=8, block_size=16).engine
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cap = FAMILIES["gemma2"]["final_logit_softcapping"]
    for prompt in prompts:
        ours = engine.runner.forward([Chunk(list(range(4)), prompt, 0, 1)])[0].float()
        with torch.no_grad():
            theirs = reference(torch.tensor([prompt])).logits[0, -1].float()
        assert ours.abs().max() <= cap and torch.allclose(ours, theirs, atol=1e-4, rtol=0)


def test_a_partial_rotary_matches(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Phi-4-mini's form: half of each head rotates (partial_rotary_factor), the rest passes through."""
    from warmstart.runtime.random_model import make_random_model

    config = {**FAMILIES["phi3"], "partial_rotary_factor": 0.5,
              "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.2, 1.7, 2.5],
                               "long_factor": [1.0, 2.0, 4.0, 8.0]}}  # fmt: skip
    model_dir = make_random_model(tmp_path / "phi4-mini-like", config, seed=0, dtype="float32")
    prompts = make_prompts(config["vocab_size"])[:8]
    _, outs = run(model_dir, prompts, num_kv_blocks=256)
    assert_all_match(model_dir, prompts, outs)
