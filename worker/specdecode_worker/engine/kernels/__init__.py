"""Attention backends and fused kernels: torch-native references and their Triton versions."""
