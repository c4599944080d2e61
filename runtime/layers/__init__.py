"""The decoder's operations in PyTorch (the CPU path, and the reference every kernel is tested against)."""
