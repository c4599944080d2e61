"""Build an ordinary Hugging Face model directory with random weights and a small trained tokenizer.

No weights can be downloaded on our machines, so tests and benchmarks use models of real shapes with
random (seeded, deterministic) weights. The directory written here is what `from_pretrained` reads:
`config.json`, `model.safetensors` (or HF-named shards plus `model.safetensors.index.json`),
`tokenizer.json`, `tokenizer_config.json` (ChatML chat template) and `generation_config.json`.

This module must not import `transformers`: it lives in `runtime/`, which has to import fast.

Init scale. Random models with HF's default init (std 0.02) give nearly flat logits with many
near-ties, which makes greedy comparisons against a reference weak, and greedy decoding of a random
model easily falls into repeating one token. Chosen by measurement on the tiny test models:
- linear weights: std 1/sqrt(fan_in); q/k projections x QK_GAIN (sharper, position-dependent attention);
  o_proj and down_proj x OUT_GAIN (the blocks outweigh the embedding in the residual stream, which
  stops a tied head from echoing the input token);
- input embedding std 1 (untied); output head std LOGIT_STD/sqrt(hidden), so logits have std ~LOGIT_STD;
  a tied matrix uses the head's scale; head rows of ids at or past the tokenizer's vocabulary (the model's
  vocabulary is often larger) are scaled by UNUSED_ROW_SCALE, so greedy decoding produces ids the
  tokenizer can decode, as a trained model would;
- biases std BIAS_STD; RMSNorm weights 1 + NORM_NOISE * N(0, 1), so they are never all exactly 1.0 and a
  bug in applying them shows; Qwen3's q_norm/k_norm weights are that times QK_GAIN (the projection scale
  is normalized away there).

Special tokens. The tokenizer always has `<|endoftext|>` = 0, `<|im_start|>` = 1, `<|im_end|>` = 2.
The config's `bos_token_id` / `eos_token_id` (and `pad_token_id`) are kept when they are below 3 (they
then name one of those tokens); otherwise bos becomes 0 and eos becomes 2 in the written config.
The tokenizer's vocabulary has min(config vocab_size, vocab_size_tokenizer or 2048) entries; the
model's vocabulary may be larger, as is common.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = [
    "SUPPORTED_ARCHITECTURES", "SPECIAL_TOKENS", "CHATML_TEMPLATE", "make_random_model", "perturb_model", "main"
]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Olmo2ForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                           "Qwen3MoeForCausalLM", "MixtralForCausalLM")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
DEFAULT_TOKENIZER_VOCAB = 2048
LOGIT_STD = 2.0
NORM_NOISE = 0.1
BIAS_STD = 0.2
OUT_GAIN = 4.0
UNUSED_ROW_SCALE = 0.1
QK_GAIN = 2.0
ROUTER_STD = 2.0

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class _Param:
    name: str
    shape: tuple[int, ...]
    kind: str  # "embed", "linear", "head", "bias", "norm"


def _load_config(config: Mapping[str, Any] | str | pathlib.Path) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return json.loads(json.dumps(dict(config)))  # deep copy, JSON-clean
    path = pathlib.Path(config)
    try:
        loaded = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"model config {path} not found") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"model config {path} is not valid JSON: {e}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"model config {path} must hold a JSON object")
    return loaded


def _architecture(cfg: Mapping[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    if archs:
        arch = str(archs[0])
    else:
        by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                   "qwen3": "Qwen3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "phi3": "Phi3ForCausalLM",
                   "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                   "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
        arch = by_type.get(str(cfg.get("model_type", "")), "")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch or '(none given)'!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _param_specs(cfg: Mapping[str, Any], arch: str) -> list[_Param]:
    hidden = int(cfg["hidden_size"])
    inter = int(cfg["intermediate_size"])
    n_layers = int(cfg["num_hidden_layers"])
    n_heads = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_heads)
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)
    vocab = int(cfg["vocab_size"])
    tied = bool(cfg.get("tie_word_embeddings", False))

    # Which biases exist, per family (as transformers builds the modules).
    if arch == "Qwen2ForCausalLM":
        qkv_bias, o_bias, mlp_bias = True, False, False
    elif arch in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        qkv_bias = o_bias = mlp_bias = False
    elif arch in ("Qwen3ForCausalLM", "Olmo2ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                  "Qwen3MoeForCausalLM"):
        qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        mlp_bias = False
    else:  # Llama
        qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        mlp_bias = bool(cfg.get("mlp_bias", False))

    gemma = arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
    norm = "offset_norm" if gemma else "norm"  # Gemma stores a norm weight's offset from 1
    specs = [_Param("model.embed_tokens.weight", (vocab, hidden), "head" if tied else "embed")]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        q_out, kv_out = n_heads * head_dim, n_kv * head_dim
        if arch != "Olmo2ForCausalLM":  # OLMo 2 normalizes each block's output instead of its input
            specs.append(_Param(p + "input_layernorm.weight", (hidden,), norm))
        if arch == "Phi3ForCausalLM":  # q, k and v in one matrix
            specs.append(_Param(f"{p}self_attn.qkv_proj.weight", (q_out + 2 * kv_out, hidden), "qk"))
        separate = (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)) if arch != "Phi3ForCausalLM" else ()
        for proj, out in separate:
            kind = "linear" if proj == "v_proj" else "qk"
            specs.append(_Param(f"{p}self_attn.{proj}.weight", (out, hidden), kind))
            if qkv_bias:
                specs.append(_Param(f"{p}self_attn.{proj}.bias", (out,), "bias"))
        specs.append(_Param(p + "self_attn.o_proj.weight", (hidden, n_heads * head_dim), "out"))
        if o_bias:
            specs.append(_Param(p + "self_attn.o_proj.bias", (hidden,), "bias"))
        if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            specs.append(_Param(p + "self_attn.q_norm.weight", (head_dim,), "qk_norm"))
            specs.append(_Param(p + "self_attn.k_norm.weight", (head_dim,), "qk_norm"))
        elif arch == "Gemma3ForCausalLM":  # per head, its weight an offset from 1
            specs.append(_Param(p + "self_attn.q_norm.weight", (head_dim,), "qk_offset_norm"))
            specs.append(_Param(p + "self_attn.k_norm.weight", (head_dim,), "qk_offset_norm"))
        elif arch == "Olmo2ForCausalLM":  # over all heads at once
            specs.append(_Param(p + "self_attn.q_norm.weight", (q_out,), "qk_norm"))
            specs.append(_Param(p + "self_attn.k_norm.weight", (kv_out,), "qk_norm"))
        # Gemma's post-block norms set the blocks' scale in the residual stream: OUT_GAIN's role
        specs.append(_Param(p + "post_attention_layernorm.weight", (hidden,),
                            "out_offset_norm" if gemma else norm))
        mlp: list[tuple[str, int, int, str]] = [("gate_proj", inter, hidden, "linear"),
                                                ("up_proj", inter, hidden, "linear")]
        if arch == "Phi3ForCausalLM":  # gate and up in one matrix
            mlp = [("gate_up_proj", 2 * inter, hidden, "linear")]
        mlp.append(("down_proj", hidden, inter, "out"))
        if experts_in(cfg, arch, i):  # a router and every expert's three matrices instead
            specs += _expert_specs(cfg, arch, p, hidden)
            mlp = []
        for proj, out, fan_in, kind in mlp:
            specs.append(_Param(f"{p}mlp.{proj}.weight", (out, fan_in), kind))
            if mlp_bias:
                specs.append(_Param(f"{p}mlp.{proj}.bias", (out,), "bias"))
        if arch == "Olmo2ForCausalLM":
            specs.append(_Param(p + "post_feedforward_layernorm.weight", (hidden,), "norm"))
        if gemma:  # sandwich norms around the MLP too
            specs.append(_Param(p + "pre_feedforward_layernorm.weight", (hidden,), "offset_norm"))
            specs.append(_Param(p + "post_feedforward_layernorm.weight", (hidden,), "out_offset_norm"))
    specs.append(_Param("model.norm.weight", (hidden,), norm))
    if not tied:
        specs.append(_Param("lm_head.weight", (vocab, hidden), "head"))
    return specs


def experts_in(cfg: Mapping[str, Any], arch: str, layer: int) -> bool:
    """Whether the layer routes to experts (Mixtral's all do; Qwen3-MoE's but for mlp_only_layers and the step)."""
    if arch == "MixtralForCausalLM":
        return True
    if arch != "Qwen3MoeForCausalLM" or not cfg.get("num_experts"):
        return False
    step = int(cfg.get("decoder_sparse_step") or 1)
    return layer not in (cfg.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def _expert_specs(cfg: Mapping[str, Any], arch: str, p: str, hidden: int) -> list[_Param]:
    """A layer's router and experts, one tensor per expert and matrix, named as the hub's checkpoints name them."""
    if arch == "MixtralForCausalLM":
        mlp, names = "block_sparse_moe", ("w1", "w3", "w2")
        count, inter = int(cfg["num_local_experts"]), int(cfg["intermediate_size"])
    else:
        mlp, names = "mlp", ("gate_proj", "up_proj", "down_proj")
        count, inter = int(cfg["num_experts"]), int(cfg["moe_intermediate_size"])
    specs = [_Param(f"{p}{mlp}.gate.weight", (count, hidden), "router")]
    for e in range(count):
        gate, up, down = names
        specs += [_Param(f"{p}{mlp}.experts.{e}.{gate}.weight", (inter, hidden), "linear"),
                  _Param(f"{p}{mlp}.experts.{e}.{up}.weight", (inter, hidden), "linear"),
                  _Param(f"{p}{mlp}.experts.{e}.{down}.weight", (hidden, inter), "out")]
    return specs


def _random_tensor(spec: _Param, gen: torch.Generator, tokenizer_vocab: int) -> torch.Tensor:
    t = torch.randn(spec.shape, generator=gen, dtype=torch.float32)
    if spec.kind == "norm":
        return t.mul_(NORM_NOISE).add_(1.0)
    if spec.kind == "router":  # logits of std ROUTER_STD: decisive routing, so that a wrong expert shows
        return t.mul_(ROUTER_STD / math.sqrt(spec.shape[1]))
    if spec.kind == "offset_norm":  # the same spread around 1, stored as the offset
        return t.mul_(NORM_NOISE)
    if spec.kind == "out_offset_norm":  # around OUT_GAIN, stored as the offset from 1
        return t.mul_(NORM_NOISE).add_(OUT_GAIN - 1)
    if spec.kind == "qk_offset_norm":  # as "qk_norm", stored as the offset from 1
        return t.mul_(NORM_NOISE).add_(1.0).mul_(QK_GAIN).sub_(1.0)
    if spec.kind == "qk_norm":  # q/k projection scale is normalized away; sharpen attention here instead
        return t.mul_(NORM_NOISE).add_(1.0).mul_(QK_GAIN)
    if spec.kind == "bias":
        return t.mul_(BIAS_STD)
    if spec.kind == "embed":
        return t
    if spec.kind == "head":
        t.mul_(LOGIT_STD / math.sqrt(spec.shape[1]))
        t[tokenizer_vocab:].mul_(UNUSED_ROW_SCALE)  # ids the tokenizer never produces stay unlikely
        return t
    if spec.kind == "qk":
        return t.mul_(QK_GAIN / math.sqrt(spec.shape[1]))
    if spec.kind == "out":
        return t.mul_(OUT_GAIN / math.sqrt(spec.shape[1]))
    return t.mul_(1.0 / math.sqrt(spec.shape[1]))  # linear: std 1/sqrt(fan_in)


def _split_shards(specs: list[_Param], num_shards: int) -> list[list[_Param]]:
    """Split parameters, in order, into `num_shards` contiguous groups of about equal size."""
    sizes = [math.prod(s.shape) for s in specs]
    total = sum(sizes)
    shards: list[list[_Param]] = [[] for _ in range(num_shards)]
    done = 0
    for spec, size in zip(specs, sizes, strict=True):
        idx = min(num_shards - 1, (done * num_shards) // total)
        # Never leave a later shard empty: jump ahead when the params left only just cover the shards left.
        remaining = len(specs) - sum(len(s) for s in shards)
        idx = max(idx, num_shards - remaining)
        shards[idx].append(spec)
        done += size
    return shards


# ----------------------------------------------------------------------------------------------------
# Tokenizer

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A warm start costs little more than the bytes it moves.
Once upon a time, in a small village by the sea, there lived an old fisherman and his daughter.
Every morning they walked down to the harbour, checked the nets and talked about the weather.
"Will it rain today?" she asked. "Perhaps," he said, "but the wind is coming from the west."
Machine learning models turn numbers into other numbers; language models turn tokens into tokens.
The server received 1,024 requests in 3.5 seconds, an average of 292.6 requests per second.
def add(a, b):
    return a + b

for i in range(10):
    print(i * i)
Water boils at 100 degrees Celsius and freezes at 0 degrees at sea level.
The library opens at nine o'clock on weekdays and at ten o'clock on Saturdays and Sundays.
She bought apples, oranges, bananas, grapes and a loaf of fresh bread at the market.
In 1969, astronauts landed on the Moon for the first time and walked on its dusty surface.
Please remember to close the window before you leave the office this evening.
Mountains, rivers, forests and deserts cover the surface of our beautiful planet.
The committee will meet again next Tuesday to discuss the budget for the coming year.
Music, painting, poetry and dance are among the oldest forms of human expression.
Can you tell me the way to the railway station? Turn left, then walk straight for two blocks.
Good software is simple, tested and measured; clever software is often none of these.
The cat slept on the warm windowsill while the rain tapped gently against the glass.
Scientists study the stars to learn how galaxies form, grow and eventually fade away.
Breakfast is served from seven until half past ten in the dining room on the ground floor.
My favourite colours are blue, green and a deep shade of red that reminds me of autumn.
The children laughed, ran across the field and chased the kite as it climbed into the sky.
Questions? Answers! Lists: one, two, three. Quotes: 'single' and "double". Brackets (round) [square] {curly}.
Email us at hello@example.com or visit https://example.com/docs for more information.
"""

_WORDS = " ".join((
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact be have do say get make go know take see come think look "
    "want give use find tell ask work seem feel try leave call good new first last long great little own "
    "other old right big high different small large next early young important few public bad same able "
    "to of in for on with at by from up about into over after beneath under above the and a that I it not "
    "he as you this but his they her she or an will my one all would there their what so out if who which "
    "go me when make can like no just him know take people into year your good some could them see other "
    "than then now look only come its over think also back after use two how our work first well way even "
    "new want because any these give day most us river garden window kitchen engine memory token vector "
    "matrix kernel cache block prefix request stream server client bucket snapshot weight layer attention "
    "window morning evening winter summer spring autumn yellow purple silver golden quiet loud bright dark "
    "happy sad careful quickly slowly gently suddenly really almost always never sometimes often together",
)).split()

_SYLLABLES = " ".join((
    "ka ri to ne mu sa lo vi de pa shi ren tal mor qui zen bra cle dro fen gar hul jin kor lum nex "
    "ost pel quo rax sil tum urb vor wen xel yam zor ain eth ion oun ble ter ing ous",
)).split()


_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _lcg(seed: int) -> Iterator[int]:
    state = seed & 0xFFFFFFFF
    while True:
        state = (1103515245 * state + 12345) & 0x7FFFFFFF
        yield state >> 8


def _corpus() -> list[str]:
    """A deterministic English-like corpus: the text above plus generated sentences and pseudo-words."""
    lines = _CORPUS.splitlines()
    rnd = _lcg(12345)
    for _ in range(400):
        n = 6 + next(rnd) % 10
        words = [_WORDS[next(rnd) % len(_WORDS)] for _ in range(n)]
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + ".,!?"[next(rnd) % 4])
    for _ in range(300):
        n = 4 + next(rnd) % 8
        words = []
        for _ in range(n):
            words.append("".join(_SYLLABLES[next(rnd) % len(_SYLLABLES)] for _ in range(1 + next(rnd) % 3)))
        lines.append(" ".join(words) + f" {next(rnd) % 10000}.")
    return lines


def _train_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    # The normalizer and pre-tokenizer of Qwen2's tokenizer: transformers 5 rebuilds a qwen2 model's
    # tokenizer with them whatever tokenizer_config.json says, so any other choice would make
    # transformers and a plain `tokenizers` load of tokenizer.json disagree for that family.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def _special_id(value: Any, default: int) -> Any:
    if isinstance(value, list):
        ids = [v for v in value if isinstance(v, int) and 0 <= v < len(SPECIAL_TOKENS)]
        return ids if ids and len(ids) == len(value) else default
    if isinstance(value, int) and 0 <= value < len(SPECIAL_TOKENS):
        return value
    return default


def _first(value: Any) -> int:
    return int(value[0]) if isinstance(value, list) else int(value)


# ----------------------------------------------------------------------------------------------------


def make_random_model(
    out_dir: str | pathlib.Path,
    config: Mapping[str, Any] | str | pathlib.Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    num_shards: int = 1,
    vocab_size_tokenizer: int | None = None,
) -> pathlib.Path:
    """Write an HF model directory with random weights for `config` into `out_dir` and return its path.

    The same config, seed and dtype give the same bytes; the weights do not depend on `num_shards`.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, not {dtype!r}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, not {num_shards}")
    cfg = _load_config(config)
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "vocab_size") if k not in cfg]
    if missing:
        raise ValueError(f"model config lacks {', '.join(missing)}")
    arch = _architecture(cfg)
    cfg["architectures"] = [arch]
    cfg.setdefault("model_type", arch.removesuffix("ForCausalLM").lower())

    tok_vocab = min(int(cfg["vocab_size"]), vocab_size_tokenizer or DEFAULT_TOKENIZER_VOCAB)
    if tok_vocab < 256 + len(SPECIAL_TOKENS):
        minimum = 256 + len(SPECIAL_TOKENS)
        raise ValueError(f"tokenizer vocabulary must hold at least {minimum} tokens, not {tok_vocab}")

    cfg["bos_token_id"] = _special_id(cfg.get("bos_token_id"), 0)
    cfg["eos_token_id"] = _special_id(cfg.get("eos_token_id"), 2)
    if "pad_token_id" in cfg and _special_id(cfg["pad_token_id"], -1) == -1:
        del cfg["pad_token_id"]
    cfg["torch_dtype"] = dtype
    cfg["dtype"] = dtype

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = _DTYPES[dtype]

    # Weights: generated in parameter order from one generator, so sharding does not change them.
    specs = _param_specs(cfg, arch)
    num_shards = min(num_shards, len(specs))
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for i, group in enumerate(_split_shards(specs, num_shards)):
        fname = "model.safetensors"
        if num_shards > 1:
            fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        tensors = {s.name: _random_tensor(s, gen, tok_vocab).to(torch_dtype) for s in group}
        total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        (out / fname).chmod(0o644)  # safetensors writes 0600
        weight_map.update(dict.fromkeys(tensors, fname))
        del tensors
    if num_shards > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen_cfg = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")

    tok = _train_tokenizer(tok_vocab)
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[_first(cfg["bos_token_id"])],
        "eos_token": SPECIAL_TOKENS[_first(cfg["eos_token_id"])],
        "pad_token": SPECIAL_TOKENS[0],
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(cfg.get("max_position_embeddings", 2048)),
        "chat_template": CHATML_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return out


def perturb_model(
    src_dir: str | pathlib.Path, out_dir: str | pathlib.Path, noise: float, seed: int = 0
) -> pathlib.Path:
    """Copy an HF model directory with every weight matrix w replaced by w + noise * std(w) * N(0, 1).

    A draft model for speculative decoding whose agreement with the original falls as ``noise`` grows:
    noise 0 is an exact copy (a draft that is always accepted)."""
    import shutil

    from safetensors.torch import load_file

    src, out = pathlib.Path(src_dir), pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for path in sorted(src.iterdir()):
        if path.suffix != ".safetensors":
            if path.is_file():
                shutil.copyfile(path, out / path.name)
            continue
        tensors = load_file(str(path))
        for name, t in tensors.items():
            if t.dim() >= 2 and noise > 0:
                w = t.float()
                tensors[name] = (w + noise * w.std() * torch.randn(w.shape, generator=gen)).to(t.dtype)
        save_file(tensors, str(out / path.name), metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runtime.random_model",
        description="Write an HF model directory with random weights for a config.json.",
        allow_abbrev=False,
    )
    parser.add_argument("config", help="path to an HF config.json")
    parser.add_argument("out_dir", help="directory to write the model into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--num-shards", type=int, default=1)
    parser.add_argument("--tokenizer-vocab", type=int, default=None, help="default 2048")
    args = parser.parse_args(argv)
    try:
        path = make_random_model(args.out_dir, args.config, seed=args.seed, dtype=args.dtype,
                                 num_shards=args.num_shards, vocab_size_tokenizer=args.tokenizer_vocab)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
