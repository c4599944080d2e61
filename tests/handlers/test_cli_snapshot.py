"""The snapshot commands as a user runs them: real subprocesses, a local store, --json on the last line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import last_json, warmstart


def test_build_inspect_tag_ls_gc(tiny_model_dir, tmp_path: Path, env: dict[str, str]) -> None:
    model = tiny_model_dir("llama")
    (tmp_path / "sys.txt").write_text("You are a helpful assistant who answers briefly and accurately. " * 4)
    first = last_json(warmstart("build", str(model), "--system", f"helper={tmp_path / 'sys.txt'}", "--dtype",
                                "float32", "--tag", "latest", "--json", env=env))
    assert first["blobs_uploaded"] == first["blobs_total"] > 0 and first["bytes_uploaded"] > 0
    again = last_json(warmstart("build", str(model), "--system", f"helper={tmp_path / 'sys.txt'}", "--dtype",
                                "float32", "--json", env=env))
    assert again["id"] == first["id"] and again["blobs_uploaded"] == 0 and again["bytes_uploaded"] == 0

    info = last_json(warmstart("inspect", "latest", "--json", env=env))
    assert info["id"] == first["id"]
    assert [p["name"] for p in info["prefixes"]] == ["helper"] and info["prefixes"][0]["tokens"] > 16
    assert info["quantization"]["scheme"] == "none" and "layers.0.qkv" in info["tensors"]

    tagged = last_json(warmstart("tag", first["id"][:8], "prod", "--json", env=env))
    assert tagged == {"ref": "prod", "id": first["id"]}
    listing = last_json(warmstart("ls", "--json", env=env))
    assert listing["refs"] == {"latest": first["id"], "prod": first["id"]}
    pulled = last_json(warmstart("pull", "prod", "--json", "--cache", str(tmp_path / "other-cache"), env=env))
    assert pulled["blobs_downloaded"] == pulled["blobs_total"]
    gc = last_json(warmstart("gc", "--dry-run", "--grace-seconds", "0", "--json", env=env))
    assert gc["blobs_deleted"] == 0  # every blob is referenced


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["build", "/does/not/exist"], "not a directory"),
        (["inspect", "nosuchref"], "nosuchref"),
        (["build", "MODEL", "--quant", "int3"], "--quant"),
        (["build", "MODEL", "--prefix", "oops"], "NAME=FILE"),
    ],
)
def test_user_errors_are_one_sentence(tiny_model_dir, env: dict[str, str], args: list[str], message: str) -> None:
    args = [str(tiny_model_dir("llama")) if a == "MODEL" else a for a in args]
    proc = warmstart(*args, env=env)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert message in proc.stderr and proc.stderr.startswith("warmstart: error:")


def test_build_to_s3_then_load_from_a_cold_cache(tiny_model_dir, tmp_path: Path, env: dict[str, str],
                                                 moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import boto3

    aws = {"AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    for key, value in aws.items():
        monkeypatch.setenv(key, value)
    boto3.client("s3").create_bucket(Bucket="snapshots")
    model = tiny_model_dir("qwen2")
    (tmp_path / "doc.txt").write_text("Every answer cites the handbook, section and page, in that order. " * 4)
    built = last_json(warmstart("build", str(model), "--store", "s3://snapshots/team", "--prefix",
                                f"handbook={tmp_path / 'doc.txt'}", "--dtype", "float32", "--tag", "prod",
                                "--json", env={**env, **aws}))
    assert "testing" not in json.dumps(built)

    from warmstart.runtime import SamplingParams
    from warmstart.snapshot.loader import load_with_report

    llm, report = load_with_report("prod", store="s3://snapshots/team", cache=tmp_path / "cold", num_kv_blocks=64)
    assert report.snapshot_id == built["id"] and report.blobs_downloaded == report.blobs_total
    prompt = llm.tokenizer.encode((tmp_path / "doc.txt").read_text() + " Where is it?")
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert out.cached_tokens == report.prefixes[0]["cached_tokens"] > 0


def test_build_of_a_path_that_is_no_directory_says_so_before_importing_torch(tmp_path: Path) -> None:
    """Issue 34, item 6: "is not a directory" took torch's 2.5-3 s of imports to say."""
    code = ("import sys; from warmstart.handlers.cli.main import main; rc = main(['build', sys.argv[1]]); "
            "print(rc, 'torch' in sys.modules)")
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "HuggingFaceTB" / "SmolLM2")],
                          capture_output=True, text=True, cwd=repo, timeout=60)  # fmt: skip
    assert done.stdout.split() == ["1", "False"], done.stdout + done.stderr
    assert "is not a directory" in done.stderr and "hub id (ORG/NAME)" in done.stderr


@pytest.mark.parametrize("command", ["build", "serve"])
def test_an_unsupported_architecture_is_one_line_before_any_work(tiny_model_dir, tmp_path: Path, command: str,
                                                                  env: dict[str, str]) -> None:  # fmt: skip
    """The architecture is read first: one line naming the ones warmstart runs, and nothing converted or stored."""
    from warmstart.runtime.models.config import SUPPORTED_ARCHITECTURES

    model = tmp_path / "neox"
    shutil.copytree(tiny_model_dir("llama"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["GPTNeoXForCausalLM"],
                                                   "model_type": "gpt_neox"}))
    store, cache = tmp_path / "store", tmp_path / "cache"
    proc = warmstart(command, str(model), "--store", str(store), "--cache", str(cache), "--port", "0", env=env) \
        if command == "serve" else warmstart(command, str(model), "--store", str(store), env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("warmstart: error:") and "GPTNeoXForCausalLM" in line and "not supported" in line
    assert all(arch in line for arch in SUPPORTED_ARCHITECTURES)
    assert not list(store.rglob("*.msgpack")) and not list(store.glob("blobs/*"))
