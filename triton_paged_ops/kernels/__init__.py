"""Triton kernels and their launchers, one family per module. Nothing here registers ops."""
