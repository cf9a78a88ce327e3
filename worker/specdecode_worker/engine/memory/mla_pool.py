"""The KV pool of multi-head latent attention (MLA, DeepSeek-V2/V3): one compressed latent per token.

Per token and layer the pool stores ``kv_lora_rank + qk_rope_head_dim`` values: the normalised
latent ``c_kv`` and the rotated shared key ``k_rope``, exactly the planner's MLA cell. Attention
with absorbed weights reads it as a single KV head: keys are the whole row and values are its
first ``kv_lora_rank`` columns, so ``v_buffer`` is a view into ``k_buffer`` and the latent is
stored once. Every tensor-parallel rank keeps the whole latent (heads are split after it).
"""

from __future__ import annotations

import torch

from .pools import to_storage


class MLATokenToKVPool:
    def __init__(self, size: int, num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.size = size
        self.num_layers = num_layers
        self.dtype = dtype
        self.kv_lora_rank = kv_lora_rank
        width = kv_lora_rank + qk_rope_head_dim
        # [size + 1, 1 head, width]; row 0 is the padding slot, as in the MHA pool.
        self.k_buffer = [torch.zeros((size + 1, 1, width), dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [k[..., :kv_lora_rank] for k in self.k_buffer]

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k`` is the latent row [N, 1, width]; ``v`` (its first columns) is already inside it."""
        self.k_buffer[layer][loc] = to_storage(k, self.dtype)

    def bytes_per_token(self) -> int:
        return sum(b[0].numel() * b.element_size() for b in self.k_buffer)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k_buffer)
