# The C extension built from runtime/kernels/cpu_gemv.c; pointers are tensors' data_ptr(), 0 for no bias.

MAX_ROWS: int

def gemv(
    out: int, x: int, weight: int, bias: int, rows: int, n: int, k: int, x_stride: int, num_threads: int, /,
) -> None: ...
def has_avx512_bf16() -> bool: ...
def decode_attention_in(
    x: int, norm_w: int, qkv_w: int, qkv_bias: int, cos: int, sin: int, positions: int, slots: int, k_cache: int,
    v_cache: int, q_out: int, h: int, qkv: int, rows: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
    head_stride: int, eps: float, num_threads: int, /,
) -> None: ...
def decode_mlp(
    attn: int, o_w: int, x: int, post_w: int, gate_up_w: int, down_w: int, x_out: int, o: int, h: int, gu: int,
    act: int, rows: int, hidden: int, attn_width: int, inter: int, eps: float, num_threads: int, /,
) -> None: ...
