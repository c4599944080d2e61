# The C extension built from runtime/kernels/cpu_gemv.c; pointers are tensors' data_ptr(), 0 for no bias.

MAX_ROWS: int

def gemv(
    out: int, x: int, weight: int, bias: int, rows: int, n: int, k: int, x_stride: int, num_threads: int, /,
) -> None: ...
def has_avx512_bf16() -> bool: ...
