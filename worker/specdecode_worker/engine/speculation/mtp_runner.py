"""The MTP (NextN) draft's runner: the target checkpoint's NextN layer, in the engine's three phases.

- create (config.json only): the draft's one KV layer is known before any weight loads.
- phase 1 ``load_weights``: the NextN layer (``model.layers.{num_hidden_layers}``) only; the
  checkpoint's copies of the embedding and lm_head are skipped, the target's serve.
- phase 2 ``alloc_memory_pool`` (ModelRunner's): a one-layer latent pool of the target's slots,
  adopting the target's req_to_token pool and allocator.
- phase 3 ``init_backends``: attention over that pool on the backend chosen for its device (the
  MLA Triton kernels on CUDA); the speculator graphs the chain's NextN steps (``capture_graphs``).

Under tensor parallelism the layer shards with the target, as the planner prices it per GPU
(``checkpoint.per_gpu_bytes``): the decoder block like a target layer (MLA heads split, latent
projections and router whole, experts split by their intermediate dimension); ``eh_proj``,
``enorm``, ``hnorm`` and ``shared_head.norm`` whole on every rank. Each rank keeps the whole
one-layer latent pool (the planner's draft cell). Rank 0 runs the rounds and announces every
target pass and NextN step to the other ranks, as for an EAGLE head (``HeadPasses.replay``).

The layer keeps its own K/V (it is not a frozen-KV draft reading the target's cache), so the
standard order of the phases serves it: target pools first, then the draft's adopting them.
Drafting rounds are the EAGLE chain's (``HeadSpeculator`` with top-k 1): the NextN layer reads
the target's hidden states the way an EAGLE head reads its features.
"""

from __future__ import annotations

import logging

import torch

from ...errors import InputError
from ...model_rules.model_config import load_shape
from ...model_rules.mtp_rule import check_mtp_draft
from ..kernels.attention import attention_backend_name, make_attn_backend
from ..model_runner import ModelRunner
from ..models.deepseek_mtp import DeepseekMTP
from ..models.loader import tensor_bytes
from ..phases import Phase, PhaseError, require

log = logging.getLogger(__name__)

class MTPRunner(ModelRunner):
    def __init__(self, model_dir: str, target_runner: ModelRunner):
        from transformers import AutoConfig

        shape = load_shape(model_dir)
        check_mtp_draft(shape, f"{model_dir}/config.json")  # the planner's rule
        # The target's group: the layer splits t ways as the target does (DeepseekMTP checks it).
        self._init_state(model_dir, "draft", target_runner.device, shape, target_runner.dtype,
                         target_runner.kv_dtype, target_runner.tp)
        self.config = AutoConfig.from_pretrained(self.model_dir)
        self.target = target_runner
        self.aux_layers = None  # the speculator's capture keeps the target's final hidden state
        self.tree_backend = None  # MTP drafts chains

    def load_weights(self) -> None:
        if self.phase >= Phase.WEIGHTS_LOADED:
            raise PhaseError(f"{self.name}: weights are already loaded")
        with torch.device("meta"):
            model = DeepseekMTP(self.config, self.tp)
        self.weights(model, self.model_dir, self.device, self.dtype)
        model.rotary.reset(self.device)
        if attention_backend_name(self.device) == "triton":
            model.stack_experts()  # small MoE passes read only the chosen experts, with no host read
        self.model = model.eval().requires_grad_(False)
        self.weight_bytes = tensor_bytes(model)  # the embedding and lm_head stay the target's
        self.phase = Phase.WEIGHTS_LOADED
        log.info("%s: loaded the NextN layer %d (%d weight bytes of its own)", self.name, model.index,
                 self.weight_bytes)

    @property
    def kv_cell_bytes(self) -> int:
        """One latent cell per token: the NextN layer's (the planner's draft cell)."""
        itemsize = torch.empty((), dtype=self.kv_dtype).element_size()
        return self.shape.kv_bytes_per_token(self.tp.size, itemsize, self.shape.num_nextn_predict_layers)

    def init_backends(self, cuda_graph_max_bs: int = 0, verify_tokens: int = 0) -> None:
        require(self.phase, Phase.POOLS_ALLOCATED, "initialise attention backends", self.name)
        self.backend = make_attn_backend(self.req_to_token_pool, self.token_to_kv_pool, None)
        log.info("%s: NextN attention on %s; chain steps are graphed by the speculator where it can",
                 self.name, type(self.backend).__name__)
        self.phase = Phase.BACKENDS_READY

def check_mtp_args(topk: int, num_steps: int | None, num_draft_tokens: int) -> None:
    """MTP drafts one chain: one proposal per step, the NextN layer reused for each."""
    if num_draft_tokens < 1:
        raise InputError("MTP needs --num-draft-tokens of at least 1")
    if topk != 1:
        raise InputError(f"--speculative-eagle-topk {topk}: MTP drafts a chain; use top-k 1")
    if num_steps is not None and num_steps != num_draft_tokens:
        raise InputError(f"MTP proposes one token per step: --num-draft-tokens ({num_draft_tokens}) must equal "
                         f"--speculative-num-steps ({num_steps})")
