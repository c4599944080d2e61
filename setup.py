"""The compiled parts: decode attention's C kernel (runtime/kernels/cpu_attention.c), the fused small ops
(runtime/kernels/cpu_small_ops.c), the bf16 matrix-vector products (runtime/kernels/cpu_gemv.c) and the batched
LoRA adds (runtime/kernels/cpu_lora.c), and the package names: the folders runtime/, snapshot/ and handlers/ install
as warmstart.runtime, warmstart.snapshot and warmstart.handlers (a plain `runtime` would collide with other installs).
Everything else is in pyproject.toml. Optional: without a C compiler the install still succeeds and runtime/layers/
uses its PyTorch paths."""

from setuptools import Extension, find_packages, setup

FOLDERS = ("runtime", "snapshot", "handlers")

HEADERS = [f"runtime/kernels/{name}.h" for name in ("bf16", "isa", "vec256", "vec512", "decode_attention")]

setup(
    package_dir={f"warmstart.{folder}": folder for folder in FOLDERS},
    packages=[f"warmstart.{name}" for name in find_packages(include=[f"{folder}*" for folder in FOLDERS])],
    ext_modules=[
        Extension(
            "warmstart.runtime.kernels._cpu_attention",
            sources=["runtime/kernels/cpu_attention.c"],
            depends=HEADERS,
            extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno"],
            extra_link_args=["-fopenmp"],
            optional=True,
        ),
        Extension(  # the small ops between the CPU path's matmuls, fused (runtime/kernels/cpu_small_ops.py)
            "warmstart.runtime.kernels._cpu_small_ops",
            sources=["runtime/kernels/cpu_small_ops.c"],
            depends=HEADERS,
            # no fused multiply-add: the kernels round where their PyTorch references do
            extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"],
            extra_link_args=["-fopenmp"],
            optional=True,
        ),
        Extension(  # many LoRA adapters over one bf16 batch, one call per linear (runtime/kernels/cpu_lora.py)
            "warmstart.runtime.kernels._cpu_lora",
            sources=["runtime/kernels/cpu_lora.c"],
            depends=HEADERS,
            extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno"],
            extra_link_args=["-fopenmp"],
            optional=True,
        ),
        Extension(  # bf16 matrix-vector products for decode steps (runtime/kernels/cpu_gemv.py)
            "warmstart.runtime.kernels._cpu_gemv",
            sources=["runtime/kernels/cpu_gemv.c"],
            depends=HEADERS,
            extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno"],
            extra_link_args=["-fopenmp"],
            optional=True,
        ),
    ]
)
