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


def pack_to_device(parts: list, device) -> list[torch.Tensor]:
    """Host int lists (or int64 host tensors) on ``device`` in one copy: views of one buffer, in
    order. Each copy to a GPU is a launch and a wait on the host, so a pass sends its metadata once."""
    flat = torch.cat([torch.as_tensor(p, dtype=torch.int64).reshape(-1) for p in parts])
    return list(torch.split(host_to_device(flat, device), [len(p) for p in parts]))


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
    last_rows: torch.Tensor | None = None  # [B] each request's last row, sent with the batch

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
        device = self.input_ids.device
        if not last_only or self.is_decode:  # one row per request: its last is every row
            return torch.arange(self.input_ids.numel(), device=device)
        if self.last_rows is not None:
            return self.last_rows
        return to_device(self.extend_lens, device).cumsum(0) - 1
