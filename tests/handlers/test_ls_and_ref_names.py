"""`warmstart ls` lists a store with bad entries in it (flagging them, exit status 3), and ref names that read
as snapshot ids or id prefixes are refused, since they would hide snapshots."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import WARMSTART
from warmstart.handlers.cli.main import main
from warmstart.handlers.cli.snapshots import LS_INCOMPLETE
from warmstart.snapshot.errors import StoreError
from warmstart.snapshot.format import FORMAT, FORMAT_VERSION, Manifest, blob_id
from warmstart.snapshot.refs import resolve_ref
from warmstart.snapshot.store import LocalStore

REPO = Path(__file__).resolve().parents[2]


def warmstart(*args: str, store: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WARMSTART_STORE": str(store), "OMP_NUM_THREADS": "1"}
    return subprocess.run([*WARMSTART, *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=REPO)


def put_snapshot(store: LocalStore, architecture: str, **fields: object) -> str:
    """A manifest with what `ls` shows (its blobs need not exist for listing)."""
    data = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": {"architecture": architecture},
            "quantization": {"scheme": "none"}, "blobs": {blob_id(architecture.encode()): 1000}, "prefixes": [],
            **fields}
    raw = Manifest(data).encode()
    store.put_manifest(blob_id(raw), raw)
    return blob_id(raw)


def put_raw_manifest(store: LocalStore, raw: bytes) -> str:
    """Bytes stored as a manifest under their own hash, past put_manifest's checks (as a foreign writer might)."""
    sid = blob_id(raw)
    (store.root / "snapshots").mkdir(parents=True, exist_ok=True)
    (store.root / "snapshots" / f"{sid}.msgpack").write_bytes(raw)
    return sid


def test_ls_lists_the_rest_and_flags_each_bad_entry(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    good = put_snapshot(store, "LlamaForCausalLM")
    other = put_snapshot(store, "Qwen2ForCausalLM")
    store.set_ref("latest", good)
    not_msgpack = put_raw_manifest(store, b"\xc1 not msgpack")
    alien = put_raw_manifest(store, Manifest({"format": "other"}).encode())
    fieldless = put_raw_manifest(store, Manifest({"format": FORMAT, "format_version": FORMAT_VERSION}).encode())
    mismatched = blob_id(b"some other bytes")
    (store.root / "snapshots" / f"{mismatched}.msgpack").write_bytes(Manifest({"format": FORMAT}).encode())
    (store.root / "refs" / "garbage").write_bytes(b"\x00\xffnot an id\n")
    (store.root / "refs" / "dangling").write_text(blob_id(b"never pushed"))
    bad_snapshots = {not_msgpack, alien, fieldless, mismatched}

    human = warmstart("ls", store=store.root)
    assert human.returncode == LS_INCOMPLETE == 3, human.stderr
    assert "Traceback" not in human.stderr and "6 entries" in human.stderr
    lines = human.stdout.splitlines()
    assert any(line.startswith(good) and "LlamaForCausalLM" in line and "refs: latest" in line for line in lines)
    assert any(line.startswith(other) and "Qwen2ForCausalLM" in line for line in lines)
    for sid in bad_snapshots:
        assert any(line.startswith(f"{sid}  unreadable: ") for line in lines), (sid, lines)
    assert any(line.startswith("ref garbage  broken: ") and "does not hold a snapshot id" in line for line in lines)
    assert any(line.startswith("ref dangling  broken: ") and "not in" in line for line in lines)

    listing = warmstart("ls", "--json", store=store.root)
    assert listing.returncode == LS_INCOMPLETE, listing.stderr
    result = json.loads(listing.stdout.strip().splitlines()[-1])
    assert [r["id"] for r in result["snapshots"]] == sorted([good, other])
    assert result["refs"] == {"latest": good, "dangling": blob_id(b"never pushed")}
    flagged = {(p["kind"], p["name"]) for p in result["problems"]}
    assert flagged == {("snapshot", s) for s in bad_snapshots} | {("ref", "garbage"), ("ref", "dangling")}
    assert all(p["error"] for p in result["problems"])

    # A bad ref elsewhere does not turn a lookup of an unknown name into an error about that ref.
    with pytest.raises(StoreError, match="no snapshot or ref 'prod'.*refs: dangling, latest"):
        resolve_ref(store, "prod")


def test_ls_of_a_sound_store_exits_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = LocalStore(tmp_path / "store")
    store.set_ref("latest", put_snapshot(store, "LlamaForCausalLM"))
    assert main(["ls", "--json", "--store", str(store.root)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["problems"] == []


@pytest.mark.parametrize("name", ["884a", "deadbeef", "DEADBEEF", "0123456789abcdef0123456789abcdef", "cafe"])
def test_a_ref_named_like_an_id_or_prefix_is_refused(name: str, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    sid = put_snapshot(store, "LlamaForCausalLM")
    with pytest.raises(StoreError, match=f"ref name '{name}' is only hex digits.*'v{name}'"):
        store.set_ref(name, sid)
    assert store.list_refs() == {}


@pytest.mark.parametrize("name", ["abc", "0123456789abcdef0123456789abcdef0", "v884a", "latest", "face-1", "tp2"])
def test_other_names_stay_allowed(name: str, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    sid = put_snapshot(store, "LlamaForCausalLM")
    store.set_ref(name, sid)
    assert store.get_ref(name) == sid


def test_a_hex_ref_made_before_the_rule_stays_readable_and_deletable(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    sid = put_snapshot(store, "LlamaForCausalLM")
    (store.root / "refs").mkdir()
    (store.root / "refs" / "cafe").write_text(sid)
    assert store.list_refs() == {"cafe": sid} and resolve_ref(store, "cafe") == sid
    store.delete_ref("cafe")
    assert store.list_refs() == {}


def test_tag_and_build_refuse_a_hex_name_before_doing_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    store = LocalStore(tmp_path / "store")
    sid = put_snapshot(store, "LlamaForCausalLM")
    shadow = sid[:4]
    tag = warmstart("tag", sid, shadow, store=store.root)
    assert tag.returncode == 1 and "Traceback" not in tag.stderr
    assert tag.stderr.startswith("warmstart: error: ") and f"ref name '{shadow}' is only hex digits" in tag.stderr
    assert store.list_refs() == {} and resolve_ref(store, shadow) == sid

    monkeypatch.setenv("WARMSTART_STORE", str(store.root))
    assert main(["build", str(tmp_path / "no-model-yet"), "--tag", "latest", "--tag", "884a"]) == 1
    assert "ref name '884a' is only hex digits" in capsys.readouterr().err  # not "no model directory"
    assert main(["tag", shadow, "v1"]) == 0
    assert store.list_refs() == {"v1": sid}
