# The C extension built from runtime/kernels/cpu_lora.c; pointers are tensors' data_ptr().

MAX_RANK: int
MAX_SLICES: int

def sgmv(
    y: int, y_stride: int, x: int, x_stride: int, a: int, b: int, rows: int, seg_slots: int, starts: int, ends: int,
    ranks: int, n: int, m: int, num_segs: int, num_slots: int, in_features: int, max_rank: int,
    slice_outs: tuple[int, int, int], num_threads: int, /,
) -> None: ...
def isa(name: str | None = None, /) -> str: ...
def best_isa() -> str: ...
