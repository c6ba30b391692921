"""Kernels written for Pallas's Mosaic GPU backend (Hopper, sm_90a)."""
