#!/bin/sh
# The wheels benchmarks/gpu_check.py needs on the device machine beyond its image (which has torch, triton,
# transformers, httpx, anyio, click, h11, urllib3, python-dateutil and the rest): starlette, uvicorn and boto3 with
# botocore, s3transfer and jmespath, at the versions of this checkout's venv, for CPython 3.12 on x86-64, into
# .whl/ (ignored by git). Then the device tool's `run` with carry [".whl"] and the command in gpu_check.py's
# docstring installs them with pip --no-index --target /tmp/site.
#
#     benchmarks/device_wheels.sh            # PYTHON=... to read the versions from another interpreter
set -eu
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
pins=$("$PYTHON" -c 'from importlib.metadata import version as v
print(" ".join(f"{n}=={v(n)}" for n in ("starlette", "uvicorn", "boto3", "botocore", "s3transfer", "jmespath")))')
rm -rf .whl
mkdir .whl
# shellcheck disable=SC2086  # $pins is a list of requirements
"$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl $pins
ls .whl
du -sh .whl
