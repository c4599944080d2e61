"""Convert an HF model directory to GGUF (no quantization) with llama.cpp's own convert_hf_to_gguf.py.

Run with the llama.cpp peer venv's python (it needs torch, transformers, sentencepiece, gguf):

    /work/peers/llamacpp/.venv/bin/python llamacpp_convert.py MODEL_DIR OUT.gguf [--outtype bf16|f32|f16|auto]
        [--converter PATH/convert_hf_to_gguf.py]

The converter is the one vendored in llama-cpp-python's sdist (vendor/llama.cpp), so it matches the
llama.cpp that the installed wheel was built from. Found, in order: --converter, $LLAMACPP_CONVERT,
then <venv>/../src/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py.

One deviation from running the script as is: our random test models ship a small trained byte-level
BPE tokenizer whose pre-tokenizer hash llama.cpp does not know, and the converter then refuses with
"BPE pre-tokenizer was not recognized". In that case (only) this wrapper records the pre-tokenizer as
"gpt-2" (the same GPT-2 regex split that tokenizers' ByteLevel(use_regex=True) does). The benchmark
feeds token ids directly, so the tokenizer never affects the figures; it only has to load.
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import runpy
import sys
from pathlib import Path


def find_converter(explicit: str | None = None) -> Path:
    cands = [explicit, os.environ.get("LLAMACPP_CONVERT")]
    prefix_parent = Path(sys.prefix).resolve().parent
    cands += sorted(glob.glob(str(prefix_parent / "src" / "llama_cpp_python-*" / "vendor" / "llama.cpp"
                                  / "convert_hf_to_gguf.py")), reverse=True)
    for c in cands:
        if c and Path(c).is_file():
            return Path(c).resolve()
    raise SystemExit("convert_hf_to_gguf.py not found: pass --converter or set LLAMACPP_CONVERT "
                     "(see benchmarks/peers/README.md)")


def convert(model_dir: str, out: str, outtype: str = "bf16", converter: str | None = None) -> None:
    script = find_converter(converter)
    root = script.parent
    sys.path.insert(0, str(root))
    sys.path.insert(1, str(root / "gguf-py"))

    from conversion import base  # noqa: E402  (llama.cpp's conversion package)

    orig = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return orig(self, tokenizer)
        except NotImplementedError:
            logging.getLogger("llamacpp_convert").warning(
                "unknown BPE pre-tokenizer hash (random test tokenizer): recording pre-tokenizer 'gpt-2'")
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(script), str(model_dir), "--outfile", str(out), "--outtype", outtype]
    runpy.run_path(str(script), run_name="__main__")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--outtype", default="bf16", choices=("bf16", "f32", "f16", "auto"))
    p.add_argument("--converter", default=None)
    a = p.parse_args()
    convert(a.model_dir, a.out, a.outtype, a.converter)
    return 0


if __name__ == "__main__":
    sys.exit(main())
