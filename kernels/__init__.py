"""SITS Triton GPU kernels, each beside the plain-PyTorch reference it is tested against."""
