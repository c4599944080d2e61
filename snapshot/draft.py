"""A draft model for speculative decoding, stored in the snapshot beside the target.

The manifest's optional ``draft`` map holds the draft's own config, tensors (its own blobs, quantized by
its own option), fingerprint and one prefix-KV entry per snapshot prefix, in the same order: the draft's
KV for the same tokens, in its own pool's layout and under the same block hashes, so a cold start fills
both pools for every prefix block.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from warmstart import runtime
from warmstart.runtime.engine.engine import LLMEngine
from warmstart.runtime.models.config import ModelConfig, ModelConfigError, read_config_json
from warmstart.runtime.models.quantize import quantize_model
from warmstart.runtime.models.weights import DTYPES, ModelWeights, load_weights
from warmstart.snapshot.build_parts import (
    BlobWriter,
    BuildOptions,
    PrefixSpec,
    pack_weights,
    prefix_engine,
    prefix_entry,
)
from warmstart.snapshot.errors import BuildError
from warmstart.snapshot.format import file_blob_id, kv_fingerprint


def build_draft(
    draft_dir: Path,
    model_dir: Path,
    target: ModelConfig,
    options: BuildOptions,
    prefixes: list[dict[str, Any]],
    blobs: BlobWriter,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """The manifest's ``draft`` section; refuses a draft whose vocabulary or tokenizer is not the target's."""
    if not draft_dir.is_dir():
        raise BuildError(f"--draft {draft_dir} is not a directory; give the draft model's HF directory")
    try:
        config_raw = read_config_json(draft_dir)
        config = ModelConfig.from_dict(config_raw, source=str(draft_dir / "config.json"))
    except ModelConfigError as e:
        raise BuildError(f"--draft: {e}") from None
    if config.vocab_size != target.vocab_size:
        raise BuildError(f"--draft {draft_dir}: its vocabulary has {config.vocab_size} tokens, the model's "
                         f"{target.vocab_size}; a draft model must share the model's tokenizer and vocabulary")
    mine, theirs = draft_dir / "tokenizer.json", model_dir / "tokenizer.json"
    if mine.is_file() and theirs.is_file() and file_blob_id(mine) != file_blob_id(theirs):
        raise BuildError(f"--draft {draft_dir}: its tokenizer.json differs from the model's; a draft model must "
                         "share the model's tokenizer and vocabulary")
    log(f"converting draft weights ({options.dtype}, quantization {options.draft_quant})")
    weights: ModelWeights = load_weights(draft_dir, config, DTYPES[options.dtype])
    if options.draft_quant != "none":
        try:
            weights = quantize_model(weights, options.draft_quant, options.draft_group_size)
        except ValueError as e:
            raise BuildError(f"--draft-quant {options.draft_quant}: {e}") from None
    tensors = pack_weights(weights, blobs)
    group_sizes = {m.get("group_size") for m in weights.quant_meta().values()} - {None}
    quantization = {"scheme": options.draft_quant, "group_size": group_sizes.pop() if len(group_sizes) == 1 else None}
    weight_blobs = sorted({t["blob"] for t in tensors.values()})
    prefix_kv = []
    if prefixes:
        engine: LLMEngine = prefix_engine(config, weights, options, max(len(p["token_ids"]) for p in prefixes))
        for p in prefixes:
            log(f"computing draft prefix KV for {p['name']!r}")
            entry = prefix_entry(PrefixSpec(p["name"], Path(), p["kind"]), p["token_ids"], engine, blobs, 1)
            if entry["block_hashes"] != p["block_hashes"]:
                raise BuildError("the draft's prefix blocks do not line up with the model's (report this as a bug)")
            prefix_kv.append({k: entry[k] for k in ("blob", "dtype", "shape")})
    return {
        "model": {"architecture": config.architecture, "config": config_raw},
        "quantization": quantization,
        "tensors": tensors,
        "quantized": weights.quant_meta(),
        "fingerprint": kv_fingerprint(weight_blobs, quantization, options.dtype, options.block_size,
                                      runtime.__version__),
        "prefix_kv": prefix_kv,
    }
