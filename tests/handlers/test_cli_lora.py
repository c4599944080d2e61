"""`warmstart build --lora NAME=DIR | --lora-merge DIR`, `warmstart inspect` listing LoRA and compiled adapters, and
`warmstart lora push`, as a user runs them (real subprocesses, a local store)."""

from __future__ import annotations

from pathlib import Path

from tests.support.cli import last_json, warmstart
from tests.support.peft_reference import make_adapter


def test_build_stores_loras_beside_compiled_adapters_and_inspect_lists_both(tiny_model_dir, tmp_path: Path,
                                                                            env: dict[str, str]) -> None:
    model = tiny_model_dir("llama")
    sql = make_adapter(model, tmp_path / "sql", "LoraConfig", seed=1, r=4, lora_alpha=8, target_modules=["q_proj"])
    soft = make_adapter(model, tmp_path / "soft", "PromptTuningConfig", seed=2, num_virtual_tokens=4)
    built = last_json(warmstart("build", str(model), "--dtype", "float32", "--lora", f"sql={sql}", "--adapter",
                                f"soft={soft}", "--tag", "both", "--json", env=env))
    assert [(lora["name"], lora["rank"]) for lora in built["loras"]] == [("sql", 4)]
    info = last_json(warmstart("inspect", "both", "--json", env=env))
    assert [a["name"] for a in info["adapters"]] == ["soft"] and info["loras"] == built["loras"]
    text = warmstart("inspect", "both", env=env).stdout
    assert "adapter soft (PROMPT_TUNING): 4 virtual tokens" in text
    assert f"lora sql: rank 4, {info['loras'][0]['bytes']:,} bytes in blob {info['loras'][0]['blob']}" in text

    pushed = last_json(warmstart("lora", "push", f"extra={sql}", "--snapshot", "both", "--json", env=env))
    assert pushed["snapshot"] == built["id"] and pushed["blobs_uploaded"] == 1  # its blob is sql's: only the document
    missing = warmstart("lora", "push", f"extra={tmp_path / 'nowhere'}", "--snapshot", "both", env=env)
    assert missing.returncode == 1 and "lora push extra: " in missing.stderr and "Traceback" not in missing.stderr


def test_a_bare_lora_dir_still_merges_with_a_deprecation_line(tiny_model_dir, tmp_path: Path,
                                                               env: dict[str, str]) -> None:
    model = tiny_model_dir("llama")
    sql = make_adapter(model, tmp_path / "sql", "LoraConfig", seed=1, r=4, lora_alpha=8, target_modules=["q_proj"])
    old = warmstart("build", str(model), "--dtype", "float32", "--lora", str(sql), "--json", env=env)
    new = last_json(warmstart("build", str(model), "--dtype", "float32", "--lora-merge", str(sql), "--json", env=env))
    assert last_json(old)["id"] == new["id"] and new["loras"] == []  # merged into the weights, as --lora-merge
    assert "--lora DIR is deprecated" in old.stderr and "--lora-merge DIR" in old.stderr
    both = warmstart("build", str(model), "--lora", str(sql), "--lora-merge", str(sql), env=env)
    assert both.returncode == 1 and "one adapter can be merged" in both.stderr
