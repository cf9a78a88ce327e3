"""What one forward pass over the paged pools needs: flattened tokens plus per-request layout."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def host_to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device``. To CUDA through pinned memory without waiting: a plain copy
    from pageable memory synchronises the stream, so the host could not run ahead. (The pinned
    copy is a fresh buffer the caching host allocator keeps until the transfer is done.)"""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_device(data, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list as a tensor on ``device`` (``host_to_device``)."""
    return host_to_device(torch.tensor(data, dtype=dtype), device)


@dataclass
class ForwardBatch:
    """Tokens of several requests, concatenated.

    Request i owns ``extend_lens[i]`` new tokens that sit at positions
    ``seq_lens[i] - extend_lens[i] .. seq_lens[i] - 1``; earlier positions are already in the KV
    pool. ``out_cache_loc`` is the KV slot of each new token (already written into
    ``req_to_token`` for its request).

    A padded verify batch (``batch.padded_chain_batch``) gives every request the same number of
    rows; those past its chain repeat its last position and write the pad slot, so its real rows
    still end at ``seq_lens[i] - 1``. Attention reads positions and ``seq_lens``, never the
    arithmetic above, so both layouts give the real rows the same result.
    """

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    out_cache_loc: torch.Tensor  # [N] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64
    extend_lens: list[int]
    seq_lens_cpu: list[int] = field(default_factory=list)

    @property
    def is_tree(self) -> bool:
        """A TreeForwardBatch: its tokens see their tree ancestors through a mask."""
        return False

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens)

    def logit_rows(self, last_only: bool) -> torch.Tensor:
        """Row indices of the flattened tokens whose logits are wanted."""
        if not last_only:
            return torch.arange(self.input_ids.numel(), device=self.input_ids.device)
        ends = to_device(self.extend_lens, self.input_ids.device).cumsum(0) - 1
        return ends
