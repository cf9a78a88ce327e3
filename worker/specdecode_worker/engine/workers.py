"""Target and draft workers: each wraps one ModelRunner and keeps its three-step split.

Constructing a worker loads its weights (phase 1) and nothing else; pools and backends come
later, when the scheduler says so.
"""

from __future__ import annotations

from .model_runner import ModelRunner
from .pools import MemoryPoolConfig, ReqToTokenPool, TokenToKVPoolAllocator


class TargetWorker:
    def __init__(self, model_dir: str, device: str, dtype: str | None = None, kv_cache_dtype: str | None = None):
        self.model_runner = ModelRunner(model_dir, device, dtype, name="target", kv_cache_dtype=kv_cache_dtype)
        self.model_runner.load_weights()

    def alloc_memory_pool(self, memory_pool_config: MemoryPoolConfig) -> None:
        self.model_runner.alloc_memory_pool(memory_pool_config)

    def get_memory_pool(self) -> tuple[ReqToTokenPool, TokenToKVPoolAllocator]:
        return self.model_runner.get_memory_pool()

    def init_backends(self, cuda_graph_max_bs: int) -> None:
        self.model_runner.init_backends(cuda_graph_max_bs)


class DraftWorker:
    """A standalone draft model: its own weights and K/V buffers, the target's slots."""

    def __init__(self, model_dir: str, device: str, dtype: str | None = None, quantization: str | None = None,
                 kv_cache_dtype: str | None = None):
        self.model_runner = ModelRunner(model_dir, device, dtype, name="draft", quantization=quantization,
                                        kv_cache_dtype=kv_cache_dtype)
        self.model_runner.load_weights()

    def alloc_memory_pool(
        self,
        memory_pool_config: MemoryPoolConfig,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
    ) -> None:
        self.model_runner.alloc_memory_pool(memory_pool_config, req_to_token_pool, token_to_kv_pool_allocator)

    def init_backends(self, cuda_graph_max_bs: int) -> None:
        self.model_runner.init_backends(cuda_graph_max_bs)
