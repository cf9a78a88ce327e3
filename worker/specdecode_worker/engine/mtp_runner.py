"""The MTP (NextN) draft's runner: the target checkpoint's NextN layer, in the engine's three phases.

- create (config.json only): the draft's one KV layer is known before any weight loads.
- phase 1 ``load_weights``: the NextN layer (``model.layers.{num_hidden_layers}``) only; the
  checkpoint's copies of the embedding and lm_head are skipped, the target's serve.
- phase 2 ``alloc_memory_pool`` (ModelRunner's): a one-layer latent pool of the target's slots,
  adopting the target's req_to_token pool and allocator.
- phase 3 ``init_backends``: torch-native attention over that pool, eagerly.

The layer keeps its own K/V (it is not a frozen-KV draft reading the target's cache), so the
standard order of the phases serves it: target pools first, then the draft's adopting them.
Drafting rounds are the EAGLE chain's (``EagleSpeculator`` with top-k 1): the NextN layer reads
the target's hidden states the way an EAGLE head reads its features.
"""

from __future__ import annotations

import logging
import time

import torch

from ..errors import InputError
from ..model_config import load_shape
from .attention import TorchNativeAttnBackend
from .distributed import SINGLE
from .loader import load_safetensors, tensor_bytes
from .model_runner import ModelRunner
from .models.deepseek_mtp import DeepseekMTP
from .phases import Phase, PhaseError, require

log = logging.getLogger(__name__)

MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM",)


class MTPRunner(ModelRunner):
    def __init__(self, model_dir: str, target_runner: ModelRunner):
        from transformers import AutoConfig

        shape = load_shape(model_dir)
        where = f"{model_dir}/config.json"
        if shape.architecture not in MTP_ARCHITECTURES:
            raise InputError(f"{where}: MTP drafting is served for {', '.join(MTP_ARCHITECTURES)}, "
                             f"not '{shape.architecture}'")
        if not shape.num_nextn_predict_layers:
            raise InputError(f"{where}: field 'num_nextn_predict_layers' must be a positive integer for MTP, got "
                             f"{shape.num_nextn_predict_layers!r}; the model has no MTP layer")
        if target_runner.tp.size > 1:
            raise InputError("MTP drafting is served with tensor parallelism 1; drop --tp for MTP "
                             "(or serve the target with NGRAM under tensor parallelism)")
        self._init_state(model_dir, "draft", target_runner.device, shape, target_runner.dtype,
                         target_runner.kv_dtype, SINGLE)
        self.config = AutoConfig.from_pretrained(self.model_dir)
        self.target = target_runner
        self.aux_layers = None  # the speculator's capture keeps the target's final hidden state
        self.tree_backend = None  # MTP drafts chains

    def load_weights(self) -> None:
        if self.phase >= Phase.WEIGHTS_LOADED:
            raise PhaseError(f"{self.name}: weights are already loaded")
        start = time.perf_counter()
        with torch.device("meta"):
            model = DeepseekMTP(self.config)
        load_safetensors(model, self.model_dir, self.device, self.dtype)
        model.rotary.reset(self.device)
        self.model = model.eval().requires_grad_(False)
        self.weight_bytes = tensor_bytes(model)  # the embedding and lm_head stay the target's
        self.phase = Phase.WEIGHTS_LOADED
        self.durations["load_weights"] = time.perf_counter() - start
        log.info("%s: loaded the NextN layer %d (%d weight bytes of its own)", self.name, model.index,
                 self.weight_bytes)

    @property
    def kv_cell_bytes(self) -> int:
        """One latent cell per token: the NextN layer's (the planner's draft cell)."""
        itemsize = torch.empty((), dtype=self.kv_dtype).element_size()
        return self.shape.kv_bytes_per_token(1, itemsize, self.shape.num_nextn_predict_layers)

    def init_backends(self, cuda_graph_max_bs: int = 0) -> None:
        require(self.phase, Phase.POOLS_ALLOCATED, "initialise attention backends", self.name)
        self.backend = TorchNativeAttnBackend(self.req_to_token_pool, self.token_to_kv_pool, None)
        log.info("%s: MTP draft steps run eagerly on the torch-native backend", self.name)
        self.phase = Phase.BACKENDS_READY
