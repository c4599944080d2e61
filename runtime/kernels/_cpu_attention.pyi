# The C extension built from runtime/kernels/cpu_attention.c; pointers are tensors' data_ptr().

MAX_GROUP: int
MAX_HEAD_DIM: int

def decode(
    out: int, q: int, k: int, v: int, tables: int, key_start: int, key_end: int,
    batch: int, heads: int, kv_heads: int, head_dim: int, block_size: int, table_width: int, head_stride: int,
    scale: float, bf16: int, num_threads: int, /,
) -> None: ...
def prefill(
    out: int, q: int, k: int, v: int, tables: int, seqs: int, nseq: int,
    heads: int, kv_heads: int, head_dim: int, block_size: int, table_width: int, head_stride: int,
    q_stride: int, out_stride: int, window: int, scale: float, bf16: int, num_threads: int, /,
) -> None: ...
def isa(name: str | None = None, /) -> str: ...  # runtime/kernels/isa.h; set all levels through isa.py
def best_isa() -> str: ...
def write_kv(
    k_pool: int, v_pool: int, k: int, v: int, slots: int, n: int, kv_heads: int, head_dim: int,
    pool_slots: int, k_stride: int, v_stride: int, elem_size: int, /,
) -> None: ...
