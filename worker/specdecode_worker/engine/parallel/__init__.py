"""Tensor parallelism: sharded layers, rank processes, and supervision across pods."""
