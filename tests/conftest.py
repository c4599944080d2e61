"""Shared fixtures: tiny random models of every family, built once per test session."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Iterator

import pytest
import torch

if not torch.cuda.is_available():
    # The kernels tests run Triton's interpreter, which Triton chooses when it is first imported, and some
    # tests import it long before them (peft does): so it is chosen here, before any test module loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.support.model_configs import FAMILIES
from warmstart.runtime.random_model import make_random_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], pathlib.Path]:
    """`tiny_model_dir(name)` -> directory of the float32 random model for FAMILIES[name] (seed 0)."""
    built: dict[str, pathlib.Path] = {}

    def get(name: str) -> pathlib.Path:
        if name not in built:
            if name not in FAMILIES:
                raise KeyError(f"no tiny model family {name!r}; known: {', '.join(FAMILIES)}")
            out = tmp_path_factory.mktemp(f"model-{name}")
            built[name] = make_random_model(out, FAMILIES[name], seed=0, dtype="float32")
        return built[name]

    return get


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """Tests check behaviour, not speed; one thread keeps torch from thrashing when servers or other test
    processes share the cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 (a real HTTP endpoint, the same code path as S3), for the session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


# The kernels' tests run at every level this CPU has from AVX2 up (fixtures and parametrizations named ``level`` and
# ``lower``). Below AVX2 (an ARM CPU, an emulated one without AVX) that set is empty, and pytest would report each as
# skipped; there they are not collected instead, and each such file has a test of the path this CPU takes (the
# PyTorch ops: same outputs as the reference, the kernel provably unused), so that a skip in these files means a
# test that could not run and should have.
KERNEL_LEVEL_ARGUMENTS = ("level", "lower")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    empty = [item for item in items for mark in item.iter_markers("skip")
             if any(str(mark.kwargs.get("reason", "")).startswith(f"got empty parameter set for ({name})")
                    for name in KERNEL_LEVEL_ARGUMENTS)]  # fmt: skip
    if empty:
        config.hook.pytest_deselected(items=empty)
        items[:] = [item for item in items if item not in empty]
