# The C extension built from runtime/kernels/cpu_small_ops.c; pointers are tensors' data_ptr(), 0 for none.

MAX_DIM: int

def rms_norm(
    out: int, sum_out: int, x: int, residual: int, weight: int, rows: int, x_stride: int, dim: int, eps: float,
    bf16: int, num_threads: int, /,
) -> None: ...
def rotary(
    q: int, k: int, cos: int, sin: int, positions: int, tokens: int, q_stride: int, k_stride: int, q_heads: int,
    k_heads: int, head_dim: int, bf16: int, num_threads: int, /,
) -> None: ...
def silu_and_mul(out: int, x: int, rows: int, width: int, bf16: int, num_threads: int, /) -> None: ...
