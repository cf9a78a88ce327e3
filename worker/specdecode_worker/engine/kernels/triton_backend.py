"""The Triton attention backend: per-batch metadata made once and reused by every layer, and the
choice per batch of the kernel that serves it (``triton_attention``): split-KV decode, split-KV
verification for a few new tokens per request, the extend kernel for prefills and trees.
"""

from __future__ import annotations

import torch

from ...contract import verify_fits
from ..forward_batch import ForwardBatch, to_device
from ..memory.pools import MHATokenToKVPool, ReqToTokenPool
from .triton_attention import decode_attention, decode_num_splits, extend_attention, verify_attention


def stream_capturing(device: torch.device) -> bool:
    """A CUDA graph is being captured on ``device``'s current stream (never on CPU)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class BatchMeta:
    """A batch's per-request metadata, made by ``make(fb, device)`` once and reused by every layer.

    Made again when a graph capture begins with the batch it was made for at warm-up (a graph
    runner's static batch): a graph must compute it itself, since the warm-up's tensors are freed,
    and their memory reused, as soon as another batch replaces them, while the graph would keep
    reading their addresses at every replay.
    """

    def __init__(self, make):
        self.make = make
        self._fb, self._capturing, self._meta = None, False, None

    def __call__(self, fb: ForwardBatch, device: torch.device):
        capturing = stream_capturing(device)
        if self._fb is not fb or self._capturing != capturing:
            self._meta = self.make(fb, device)
            self._fb, self._capturing = fb, capturing
        return self._meta


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    # The interpreter on CPU: any fixed value gives the same numbers. It runs each program in turn,
    # so few splits keep the whole-engine tests quick; the kernel tests choose theirs.
    return 2


class TritonAttnBackend:
    fixed_width_under_graphs = False  # lengths are read on the device
    """Same interface as TorchNativeAttnBackend and TreeAttnBackend: one object serves decode,
    extend (prefill, chain verification) and tree batches (a ``TreeForwardBatch``)."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: MHATokenToKVPool, sliding_window: int | None):
        self.req_to_token = req_to_token_pool.req_to_token
        self.kv_pool = kv_pool
        self.sliding_window = sliding_window
        self.num_sms = _sm_count(self.req_to_token.device)
        self._meta = BatchMeta(lambda fb, device: self._tree_meta(fb, device) if fb.is_tree
                               else self._extend_meta(fb, device))

    def num_splits(self, batch_size: int) -> int:
        return decode_num_splits(batch_size, self.kv_pool.k_buffer[0].shape[1], self.num_sms)

    def forward(self, q, k, v, layer_id: int, fb: ForwardBatch, scaling: float) -> torch.Tensor:
        """q: [N, H, D], k/v: [N, Hkv, D] for the new tokens; returns [N, H, Dv]."""
        self.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id]
        tree = fb.is_tree
        if fb.is_decode and not tree:
            return decode_attention(q, k_buf, v_buf, self.req_to_token, fb.req_pool_indices, fb.seq_lens, scaling,
                                    self.sliding_window, self.num_splits(fb.batch_size))
        q_start, q_lens, linear_lens, max_q_len, extra = self._meta(fb, q.device)
        if verify_fits(max_q_len, q.shape[1] // k_buf.shape[1]):
            return verify_attention(q, k_buf, v_buf, self.req_to_token, fb.req_pool_indices, q_start, q_lens,
                                    linear_lens, fb.positions, max_q_len, scaling, self.sliding_window,
                                    self.num_splits(fb.batch_size), extra)
        return extend_attention(q, k_buf, v_buf, self.req_to_token, fb.req_pool_indices, q_start, q_lens,
                                linear_lens, fb.positions, max_q_len, scaling, self.sliding_window, extra)

    @staticmethod
    def _starts(lens: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
        B = len(lens)
        if B and all(n == lens[0] for n in lens):  # uniform (verify batches): no host-to-device copy
            n = lens[0]
            return torch.arange(B, device=device) * n, torch.full((B,), n, dtype=torch.int64, device=device)
        q_lens = to_device(lens, device, torch.int64)  # pinned: a pageable copy would wait for the stream
        return torch.cumsum(q_lens, 0) - q_lens, q_lens

    def _extend_meta(self, fb: ForwardBatch, device):
        q_start, q_lens = self._starts(fb.extend_lens, device)
        return q_start, q_lens, fb.seq_lens, max(fb.extend_lens), None

    def _tree_meta(self, fb, device):
        # Views of the batch's own tensors (a graph's static buffers), and constants of its shape.
        batch, n, width = fb.mask.shape
        q_start, q_lens = self._starts(fb.extend_lens, device)
        e_start = torch.arange(batch + 1, dtype=torch.int64, device=device) * width
        m_start = torch.arange(batch, dtype=torch.int64, device=device) * (n * width)
        extra = (e_start, fb.key_slots.reshape(-1), fb.key_positions.reshape(-1), m_start, fb.mask.reshape(-1))
        return q_start, q_lens, fb.prefix_lens, n, extra
