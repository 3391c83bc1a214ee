"""Triton kernels for ironlm (shipped inside the wheel as ``ironlm.kernels``)."""
