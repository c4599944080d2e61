"""`warmstart serve`'s API key, each way it can be given: `--api-key KEY`, `--api-key-env NAME` and
$WARMSTART_API_KEY. Each server, started for real, answers 401 without the key; an option that resolves to no key
refuses to start in one line; and no option is read as a prefix of another (argparse's abbreviations are off, which
once made `--api-key secret` mean `--api-key-env secret` and serve everyone)."""

from __future__ import annotations

import argparse
import os
import subprocess
from collections.abc import Iterator

import httpx
import pytest

from tests.support.cli import WARMSTART
from tests.support.serving import KEY, REPO, ServerProcess, TinySnapshot, build_tiny_snapshot, ready_side_by_side
from warmstart.handlers.cli.main import build_parser


@pytest.fixture(scope="module")
def snap(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> TinySnapshot:  # type: ignore[no-untyped-def]
    return build_tiny_snapshot(tiny_model_dir("llama"), tmp_path_factory.mktemp("auth"))


WAYS = {  # how the key is given -> (serve's extra arguments, its environment, the key it must want)
    "--api-key": (("--api-key", "secret123"), {"WARMSTART_API_KEY": ""}, "secret123"),
    "--api-key-env": (("--api-key-env", "MY_SERVICE_KEY"), {"MY_SERVICE_KEY": "from-my-var"}, "from-my-var"),
    "WARMSTART_API_KEY": ((), {}, KEY),
}


@pytest.fixture(scope="module")
def servers(snap: TinySnapshot) -> Iterator[dict[str, ServerProcess]]:
    started = {way: ServerProcess(snap, *args, env=env) for way, (args, env, _) in WAYS.items()}  # side by side
    with ready_side_by_side(started) as servers:
        yield servers


@pytest.mark.parametrize("way", list(WAYS))
def test_each_way_of_giving_the_key_turns_auth_on(servers: dict[str, ServerProcess], way: str) -> None:
    url, key = servers[way].url, WAYS[way][2]
    assert httpx.get(url + "/health").status_code == 200
    wrong = {KEY, "secret123", "from-my-var"} - {key}
    for path in ("/v1/models", "/status", "/metrics"):
        assert httpx.get(url + path).status_code == 401
        for other in wrong:  # the other ways' keys: this server wants its own only
            assert httpx.get(url + path, headers={"Authorization": f"Bearer {other}"}).status_code == 401
        assert httpx.get(url + path, headers={"Authorization": f"Bearer {key}"}).status_code == 200
    ready = next(e for e in servers[way].events if e.get("phase") == "ready")  # the fixture waited for it
    chat = {"model": ready["model"], "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(url + "/v1/chat/completions", json=chat).status_code == 401


def serve(snap: TinySnapshot, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*WARMSTART, "serve", "tiny", "--store", str(snap.store),
                           "--cache", str(snap.cache), "--port", "0", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**os.environ, **env})  # fmt: skip


@pytest.mark.parametrize(("args", "env", "says"), [
    (("--api-key", ""), {}, "--api-key is empty"),
    (("--api-key", "  "), {}, "--api-key is empty"),
    (("--api-key-env", "NO_SUCH_KEY_VAR"), {}, "--api-key-env NO_SUCH_KEY_VAR: that environment variable is not set"),
    (("--api-key-env", "EMPTY_KEY_VAR"), {"EMPTY_KEY_VAR": ""}, "that environment variable is empty"),
])  # fmt: skip
def test_an_auth_option_that_gives_no_key_refuses_to_start(snap: TinySnapshot, args: tuple[str, ...],
                                                           env: dict[str, str], says: str) -> None:  # fmt: skip
    done = serve(snap, *args, env={**env, "WARMSTART_API_KEY": "would-have-been-used"})
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("warmstart: error: ") and says in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and '"listening"' not in done.stdout


def test_prefixes_of_options_are_not_options(snap: TinySnapshot) -> None:
    for args in (("--api-key-e", "X"), ("--api", "secret"), ("--max-num", "4")):
        done = serve(snap, *args, env={})
        assert done.returncode == 2 and "unrecognized arguments" in done.stderr, (args, done.stderr)
    both = serve(snap, "--api-key", "a", "--api-key-env", "B", env={"B": "b"})
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from parsers(child)


def test_no_parser_of_the_cli_abbreviates() -> None:
    every = list(parsers(build_parser()))
    assert len(every) > 10 and all(not p.allow_abbrev for p in every)
    assert {p.prog.split()[-1] for p in every} >= {"serve", "build", "push", "template", "demo"}

