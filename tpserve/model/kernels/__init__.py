"""Compute kernels: the torch reference ops (CPU and test oracle) and Triton ops (CUDA)."""
