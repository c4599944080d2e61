"""The one compiled part: decode attention's C kernel (runtime/kernels/cpu_attention.c). Everything else is in
pyproject.toml. Optional: without a C compiler the install still succeeds and runtime/layers/attention.py uses its
PyTorch path."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "runtime.kernels._cpu_attention",
            sources=["runtime/kernels/cpu_attention.c"],
            extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
)
