# The C extension built from runtime/kernels/cpu_attention.c; pointers are tensors' data_ptr().

MAX_GROUP: int
MAX_HEAD_DIM: int

def decode(
    out: int, q: int, k: int, v: int, tables: int, key_start: int, key_end: int,
    batch: int, heads: int, kv_heads: int, head_dim: int, block_size: int, table_width: int, head_stride: int,
    scale: float, bf16: int, num_threads: int, /,
) -> None: ...
