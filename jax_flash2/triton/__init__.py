"""Pallas kernels through the Triton lowering (any NVIDIA GPU from Ampere on)."""
