"""Triton kernels: head_mean.py, the fused head-mean attention map that flowtracer.Capture runs on CUDA."""
