"""An EAGLE / EAGLE3 head's runner, and what a target pass keeps for a head to read.

The head keeps the engine's three-step split: its runner's ``load_weights`` reads the head only
(the target's embedding and lm_head are borrowed, never copied); ``alloc_memory_pool`` adopts the
target's req_to_token pool and allocator and adds the head's own K/V buffers; ``init_backends``
sets up its attention backends. The MTP (NextN) layer's runner stands beside it (``mtp_runner``).
"""

from __future__ import annotations

import logging

import torch

from ...errors import InputError
from ...model_rules.model_config import load_shape, read_config
from ..kernels.attention import make_attn_backend
from ..kernels.tree_attention import make_tree_attn_backend
from ..model_runner import ModelRunner
from ..models.eagle_loader import head_config, load_eagle_head
from ..models.loader import tensor_bytes
from ..parallel.parallel_layers import check_splits
from ..phases import Phase, PhaseError, require
from . import algorithms

log = logging.getLogger(__name__)


class HiddenCapture:
    """Collects, during a target forward, the hidden states a head reads (see LlamaForCausalLM)."""

    def __init__(self, aux_layers: list[int] | None):
        self.aux_layers = aux_layers
        self.aux: dict[int, torch.Tensor] = {}
        self.last: torch.Tensor | None = None

    def take(self, index: int, x: torch.Tensor, norm=None) -> None:
        if self.aux_layers is None:
            if norm is not None:
                self.last = norm(x)
        elif index in self.aux_layers:
            self.aux[index] = x

    def features(self) -> torch.Tensor:
        if self.aux_layers is None:
            return self.last
        return torch.cat([self.aux[i] for i in self.aux_layers], dim=-1)


class EagleRunner(ModelRunner):
    """The head on one device, sharded as the target is; phases 2 and 3 are ModelRunner's (the
    head's own K/V layers, ``max(1, kv / t)`` heads per rank)."""

    def __init__(self, model_dir: str, target_runner: ModelRunner, algorithm_name: str):
        method = algorithms.algorithm(algorithm_name)
        if method.drafter is not algorithms.Drafter.HEAD:
            raise ValueError(f"{algorithm_name} drafts with no EAGLE head")
        tp = target_runner.tp
        if tp.size > 1:  # the planner's rule: the head splits t ways as the target does
            check_splits(head_config(read_config(model_dir)), tp.size, f"{model_dir}/config.json")
        # config.json only (the layer count is known before any weight); dtypes are the target's.
        self._init_state(model_dir, "draft", target_runner.device, load_shape(model_dir), target_runner.dtype,
                         target_runner.kv_dtype, tp)
        self.algorithm, self.method = algorithm_name, method
        self.target = target_runner
        self.aux_layers: list[int] | None = None
        self.tree_backend = None  # set in phase 3

    def load_weights(self) -> None:
        if self.phase >= Phase.WEIGHTS_LOADED:
            raise PhaseError(f"{self.name}: weights are already loaded")
        require(self.target.phase, Phase.WEIGHTS_LOADED, "load an EAGLE head that shares the target's embedding",
                self.name)
        t = self.target.shape
        loaded = load_eagle_head(self.model_dir, self.method.name, self.method.feature_layers, t.hidden_size,
                                 t.vocab_size, t.num_hidden_layers, self.device, self.dtype, self.tp)
        self.model, self.aux_layers = loaded.head, loaded.aux_layers
        self.weight_bytes = tensor_bytes(self.model)  # shared tensors stay in the target's module
        if loaded.skipped_shared:
            log.info("%s: %s served by the target (checkpoint copy not loaded)", self.name,
                     ", ".join(loaded.skipped_shared))
        self.phase = Phase.WEIGHTS_LOADED
        log.info("%s: loaded %s head (%d weight bytes of its own)", self.name, self.algorithm, self.weight_bytes)

    def init_backends(self, cuda_graph_max_bs: int = 0) -> None:
        require(self.phase, Phase.POOLS_ALLOCATED, "initialise attention backends", self.name)
        self.backend = make_attn_backend(self.req_to_token_pool, self.token_to_kv_pool, None)
        self.tree_backend = make_tree_attn_backend(self.req_to_token_pool, self.token_to_kv_pool, None)
        log.info("%s: chain draft steps are graphed by the speculator where the backend allows", self.name)
        self.phase = Phase.BACKENDS_READY


def check_tree_args(topk: int, num_steps: int, num_draft_tokens: int) -> None:
    if topk < 1 or num_steps < 1 or num_draft_tokens < 1:
        raise InputError("EAGLE needs --speculative-eagle-topk, --speculative-num-steps and "
                         "--num-draft-tokens of at least 1")
    if topk == 1 and num_draft_tokens != num_steps:
        raise InputError(f"chain drafting (top-k 1) proposes one token per step: --num-draft-tokens "
                         f"({num_draft_tokens}) must equal --speculative-num-steps ({num_steps})")
    candidates = topk + (num_steps - 1) * topk * topk
    if topk > 1 and num_draft_tokens > candidates:
        raise InputError(f"a tree of top-k {topk} over {num_steps} steps has {candidates} candidates; "
                         f"--num-draft-tokens {num_draft_tokens} must not exceed that")
