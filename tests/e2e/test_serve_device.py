"""`warmstart serve --device` as real processes: the Triton kernels (under Triton's
interpreter, on CPU tensors: the CUDA path's wiring without a GPU) serve the same greedy tokens as the PyTorch
path, through prefix hits too; /status and /metrics say which device and ops serve; a GPU that is not there
ends the process at once with one sentence."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.cli import WARMSTART
from tests.support.serving import (
    AUTH,
    REF,
    REPO,
    SYSTEM_TEXT,
    ServerProcess,
    TinySnapshot,
    build_tiny_snapshot,
    ready_side_by_side,
)

SERVE_ARGS = ("--num-kv-blocks", "64", "--max-model-len", "256")
TRITON = {"WARMSTART_KERNELS": "triton", "TRITON_INTERPRET": "1"}


@pytest.fixture(scope="module")
def snap(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> TinySnapshot:  # type: ignore[no-untyped-def]
    return build_tiny_snapshot(tiny_model_dir("llama"), tmp_path_factory.mktemp("serve-device"))


@pytest.fixture(scope="module")
def servers(snap: TinySnapshot) -> Iterator[dict[str, ServerProcess]]:
    """The same snapshot served on the PyTorch ops (device auto: the CPU here) and on the Triton kernels."""
    env = {k: v for k, v in os.environ.items() if k not in TRITON}
    started = {"torch": ServerProcess(snap, "--device", "auto", *SERVE_ARGS, env=env),
               "triton": ServerProcess(snap, "--device", "cpu", *SERVE_ARGS, env=TRITON)}  # fmt: skip
    with ready_side_by_side(started) as servers:
        yield servers


REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": [5, 6, 7, 8, 9], "max_tokens": 8, "logprobs": 1}),
    ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 8, "logprobs": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": SYSTEM_TEXT},  # the snapshot's prefix
                                           {"role": "user", "content": "Hello there"}], "max_tokens": 6}),
]


def generate(server: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    body = {"model": REF, "temperature": 0, "ignore_eos": True, **body}
    response = httpx.post(server.url + path, json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


@pytest.mark.kernels
def test_triton_kernels_serve_the_torch_paths_greedy_tokens(servers: dict[str, ServerProcess]) -> None:
    for path, body in REQUESTS:
        torch_out, triton_out = (generate(servers[ops], path, body) for ops in ("torch", "triton"))
        choice, expected = triton_out["choices"][0], torch_out["choices"][0]
        if path == "/v1/completions":
            assert choice["logprobs"]["tokens"] == expected["logprobs"]["tokens"], body
            assert choice["text"] == expected["text"]
        else:
            assert choice["message"]["content"] == expected["message"]["content"]
        assert triton_out["usage"] == torch_out["usage"]
    assert triton_out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the chat hit the snapshot's prefix


@pytest.mark.kernels
def test_status_and_metrics_say_which_device_and_ops_serve(servers: dict[str, ServerProcess]) -> None:
    for ops, server in servers.items():
        status = httpx.get(server.url + "/status", headers=AUTH).json()
        assert (status["device"], status["ops"]) == ("cpu", ops)
        assert (status["details"]["ready"]["device"], status["details"]["ready"]["ops"]) == ("cpu", ops)
        assert "device_copy" not in status["phases"]  # on the CPU the weights stay mapped
        text = httpx.get(server.url + "/metrics", headers=AUTH).text
        info = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "warmstart:engine_info"]
        assert [(s.labels["device"], s.labels["ops"], s.value) for s in info] == [("cpu", ops, 1.0)]
        ready = next(e for e in server.events if e.get("phase") == "ready")
        assert (ready["device"], ready["ops"]) == ("cpu", ops)


def serve(snap: TinySnapshot, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*WARMSTART, "serve", REF, "--store", str(snap.store), "--cache",
                             str(snap.cache), "--port", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_gpu_that_is_not_there_ends_the_process_with_one_sentence(snap: TinySnapshot) -> None:
    procs = {name: serve(snap, "--device", name) for name in ("cuda", "cuda:3")}  # side by side: each imports torch
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 1, stderr
        assert stderr.startswith(f"warmstart: error: device '{name}' was asked for, but torch ")
        assert "sees no CUDA device on this machine; use device 'cpu'" in stderr
        assert stderr.count("\n") == 1 and "Traceback" not in stderr


@pytest.mark.parametrize(("flag", "value", "words"), [
    ("--device", "gpu", "expected auto, cpu, cuda or cuda:N, got 'gpu'"),
    ("--gpu-memory-utilization", "1.5", "expected a number in (0, 1], got 1.5"),
    ("--gpu-memory-utilization", "0", "expected a number in (0, 1], got 0"),
])  # fmt: skip
def test_bad_device_flags_are_refused_before_anything_starts(snap: TinySnapshot, flag: str, value: str,
                                                             words: str) -> None:
    proc = serve(snap, flag, value)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2 and words in stderr and stdout == ""
