# The C extension built from runtime/kernels/cpu_gemv.c; pointers are tensors' data_ptr(), 0 for no bias.

MAX_ROWS: int

def gemv(
    out: int, x: int, weight: int, bias: int, rows: int, n: int, k: int, x_stride: int, num_threads: int, /,
) -> None: ...
def isa(name: str | None = None, /) -> str: ...  # runtime/kernels/isa.h; set all levels through isa.py
def best_isa() -> str: ...
def decode_layers(
    x: int, layer_table: int, cos: int, sin: int, positions: int, slots: int, tables: int, key_starts: int,
    key_ends: int, rows: int, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int,
    block_size: int, table_width: int, head_stride: int, eps: float, num_threads: int, final_norm: int, head: int,
    vocab: int, logits: int, /,
) -> None: ...
