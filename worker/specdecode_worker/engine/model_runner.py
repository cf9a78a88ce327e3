"""One model on one device, initialised in three separate steps.

``load_weights`` (phase 1), ``alloc_memory_pool`` (phase 2: create pools, or adopt the target's
req_to_token pool and allocator for a draft), ``init_backends`` (phase 3). Each step checks that
the one before it has finished, so an out-of-order call fails with the phase it needed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..errors import InputError
from ..model_rules.model_config import load_shape
from .forward_batch import ForwardBatch
from .kernels.cpu_linear import cpu_packing
from .kernels.attention import TorchNativeAttnBackend, attention_backend_name, make_attn_backend
from .memory.kv_slots import KVSlots
from .memory.pools import MemoryPoolConfig, MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator, resolve_kv_dtype
from .models import model_class
from .models.loader import WeightSource, load_safetensors, tensor_bytes
from .parallel.mirror import Mirror
from .parallel.parallel_layers import model_tp
from .phases import Phase, PhaseError, require

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str | None, config_dtype, device: str) -> torch.dtype:
    if name in (None, "auto"):
        if isinstance(config_dtype, torch.dtype):
            dtype = config_dtype
        else:
            dtype = DTYPES.get(str(config_dtype or "float32").replace("torch.", ""), torch.float32)
        # Half precision matmuls on CPU are slow and inexact; serve CPU in float32.
        return torch.float32 if device == "cpu" else dtype
    if name not in DTYPES:
        raise InputError(f"dtype '{name}' is not supported; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


class ModelRunner:
    def __init__(self, model_dir: str | Path, device: str = "cpu", dtype: str | None = None, name: str = "target",
                 quantization: str | None = None, kv_cache_dtype: str | None = None):
        """Reads config.json only (shape, dtypes, sharding); weights wait for ``load_weights``."""
        from transformers import AutoConfig

        device = torch.device(device)
        shape = load_shape(model_dir)  # config.json only: layer count known before any weight
        self.config = AutoConfig.from_pretrained(str(model_dir))
        self.model_cls = model_class(shape.architecture, f"{model_dir}/config.json")
        config_dtype = getattr(self.config, "dtype", None) or getattr(self.config, "torch_dtype", None)
        dtype = resolve_dtype(dtype, config_dtype, device.type)
        if quantization not in (None, "int8"):
            raise InputError(f"quantization '{quantization}' is not supported; use int8 (cpu only) or none")
        if quantization and device.type != "cpu":
            raise InputError("int8 dynamic quantization runs on cpu only; drop it on cuda")
        tp = model_tp(self.config, name, f"{model_dir}/config.json")  # sharded, or a replicated draft
        if quantization and tp.size > 1:
            raise InputError(f"int8 dynamic quantization quantizes whole linears; the {name} is sharded over "
                             f"{tp.size} ranks here: drop the quantization or serve with --tp 1")
        self._init_state(model_dir, name, device, shape, dtype, resolve_kv_dtype(kv_cache_dtype, dtype), tp,
                         quantization)

    def _init_state(self, model_dir, name: str, device: torch.device, shape, dtype: torch.dtype,
                    kv_dtype: torch.dtype, tp, quantization: str | None = None) -> None:
        """Everything a runner holds, before phase 1; subclasses resolve the arguments their own way."""
        self.model_dir = str(model_dir)
        self.name = name
        self.device = device
        self.shape = shape
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.tp = tp
        self.mirror = Mirror(tp)  # where its passes go to the group's other ranks (rank 0 only)
        self.quantization = quantization
        self.weights: WeightSource = load_safetensors  # where phase 1 reads the weights from
        self.phase = Phase.CREATED
        self.model = None
        self.weight_bytes = 0
        self.memory_pool_config: MemoryPoolConfig | None = None
        self.req_to_token_pool: ReqToTokenPool | None = None
        self.token_to_kv_pool_allocator: TokenToKVPoolAllocator | None = None
        self.token_to_kv_pool: MHATokenToKVPool | None = None
        self.backend: TorchNativeAttnBackend | None = None
        self.cuda_graphs = None
        self.verify_graphs = None
        self.extend_graphs = None  # a draft's first step over several new tokens (last rows' logits)
        self.vocabulary = None  # a DraftVocabulary when this draft pads its vocabulary unlike the target

    # phase 1
    def load_weights(self) -> None:
        if self.phase >= Phase.WEIGHTS_LOADED:
            raise PhaseError(f"{self.name}: weights are already loaded")
        with torch.device("meta"):
            model = self.model_cls(self.config, **({"tp": self.tp} if self.tp.size > 1 else {}))
        self.weights(model, self.model_dir, self.device, self.dtype)
        model.rotary.reset(self.device)
        if attention_backend_name(self.device) == "triton":
            model.stack_experts()  # small MoE passes read only the chosen experts, with no host read
        if self.quantization == "int8":
            # Dynamic int8 linear layers in the decoder (a cheap CPU draft); the tied head stays.
            model.model.layers = torch.ao.quantization.quantize_dynamic(model.model.layers, {torch.nn.Linear},
                                                                        torch.qint8)
        if self.quantization != "int8":
            model.fuse_projections()  # fewer, larger matrix products per layer; the same bytes
            if self.device.type == "cpu" and cpu_packing():
                model.pack_weights()  # reordered for oneDNN once, not at every product; the same bytes
        self.model = model.eval().requires_grad_(False)  # no autograd state, also in CUDA graphs
        self.weight_bytes = tensor_bytes(model)
        self.phase = Phase.WEIGHTS_LOADED
        log.info("%s: loaded %s (%d weight bytes, %s)", self.name, self.shape.architecture, self.weight_bytes,
                 self.dtype)

    @property
    def kv_cell_bytes(self) -> int:
        """KV bytes per token of this model's pool (all its layers, its KV dtype)."""
        itemsize = torch.empty((), dtype=self.kv_dtype).element_size()
        return self.shape.kv_bytes_per_token(self.tp.size, itemsize, self.shape.num_hidden_layers)

    # phase 2
    def alloc_memory_pool(
        self,
        memory_pool_config: MemoryPoolConfig | None = None,
        req_to_token_pool: ReqToTokenPool | None = None,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator | None = None,
        slots: KVSlots | None = None,
    ) -> None:
        """Create the pools from ``memory_pool_config``, adopting the shared ones when given (and
        ``slots``, their owner: one object hands out every pool's slots)."""
        require(self.phase, Phase.WEIGHTS_LOADED, "allocate KV pools", self.name)
        if self.phase >= Phase.POOLS_ALLOCATED:
            raise PhaseError(f"{self.name}: KV pools are already allocated")
        if memory_pool_config is None:
            raise PhaseError(
                f"{self.name}: phase 2 needs a MemoryPoolConfig sized with every weight resident "
                "(Engine.init_memory_pools computes it)"
            )
        if (req_to_token_pool is None) != (token_to_kv_pool_allocator is None):
            raise ValueError("adopt the req_to_token pool and the token allocator together, or neither")
        cfg = memory_pool_config
        self.memory_pool_config = cfg
        self.req_to_token_pool = req_to_token_pool or ReqToTokenPool(cfg.max_running_requests, cfg.context_len,
                                                                     self.device)
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator or TokenToKVPoolAllocator(
            cfg.max_total_num_tokens, self.device)
        if self.token_to_kv_pool_allocator.size != cfg.max_total_num_tokens:
            raise ValueError(f"{self.name}: adopted allocator holds {self.token_to_kv_pool_allocator.size} slots, "
                             f"config says {cfg.max_total_num_tokens}")
        # A model with its own cell layout (MLA's latent) makes its pool; the others share one layout.
        self.token_to_kv_pool = self.model.make_kv_pool(cfg.max_total_num_tokens, self.kv_dtype, self.device)
        if self.token_to_kv_pool is None:
            self.token_to_kv_pool = MHATokenToKVPool(
                cfg.max_total_num_tokens, self.shape.num_hidden_layers, self.shape.kv_heads_per_gpu(self.tp.size),
                self.shape.head_dim, self.shape.v_head_dim, self.kv_dtype, self.device,
            )
        self._slots = slots
        self.phase = Phase.POOLS_ALLOCATED
        log.info("%s: KV pool of %d tokens (%d bytes, %s), %s req_to_token pool", self.name, cfg.max_total_num_tokens,
                 self.token_to_kv_pool.nbytes(), str(self.kv_dtype).replace("torch.", ""),
                 "adopted" if req_to_token_pool is not None else "own")

    def get_memory_pool(self) -> tuple[ReqToTokenPool, TokenToKVPoolAllocator]:
        require(self.phase, Phase.POOLS_ALLOCATED, "share its pools", self.name)
        return self.req_to_token_pool, self.token_to_kv_pool_allocator

    @property
    def slots(self) -> KVSlots:
        """Rows and slots of the pools it holds or adopted (a draft's are the target's)."""
        require(self.phase, Phase.POOLS_ALLOCATED, "hand out KV slots", self.name)
        if self._slots is None:
            self._slots = KVSlots(self.req_to_token_pool, self.token_to_kv_pool_allocator)
        return self._slots

    # phase 3
    def init_backends(self, cuda_graph_max_bs: int = 0, verify_tokens: int = 0, extend_tokens: int = 0) -> None:
        """Attention backend, then CUDA graphs for decode batches and, with a backend that reads
        lengths at replay (Triton), for verify batches of ``verify_tokens`` rows per request and
        for left-padded extends of ``extend_tokens`` (their last rows' logits), where above 1."""
        require(self.phase, Phase.POOLS_ALLOCATED, "initialise attention backends", self.name)
        self.backend = make_attn_backend(self.req_to_token_pool, self.token_to_kv_pool, self.model.sliding_window)
        if self.device.type == "cuda" and cuda_graph_max_bs > 0:
            from .cuda_graph import CudaGraphRunner

            self.cuda_graphs = CudaGraphRunner(self.model, self.backend, cuda_graph_max_bs,
                                               self.memory_pool_config.context_len, self.device)
            if verify_tokens > 1 and not self.backend.fixed_width_under_graphs:
                self.verify_graphs = CudaGraphRunner(self.model, self.backend, cuda_graph_max_bs,
                                                     self.memory_pool_config.context_len, self.device,
                                                     tokens_per_req=verify_tokens, pool=self.cuda_graphs.pool)
            if extend_tokens > 1 and not self.backend.fixed_width_under_graphs:
                self.extend_graphs = CudaGraphRunner(self.model, self.backend, cuda_graph_max_bs,
                                                     self.memory_pool_config.context_len, self.device,
                                                     tokens_per_req=extend_tokens, pool=self.cuda_graphs.pool,
                                                     last_only=True)
        else:
            log.info("%s: CUDA graphs skipped on %s", self.name,
                     self.device.type if cuda_graph_max_bs else "request (max batch 0)")
        self.phase = Phase.BACKENDS_READY

    def extend_width(self, batch_size: int) -> int:
        """Rows per request of the extend graphs that take ``batch_size`` requests (0: none)."""
        graphs = self.extend_graphs
        return graphs.tokens_per_req if graphs is not None and batch_size <= graphs.max_bs else 0

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, last_only: bool) -> torch.Tensor:
        require(self.phase, Phase.BACKENDS_READY, "run a forward pass", self.name)
        if self.vocabulary is not None:
            fb.input_ids = self.vocabulary.inputs(fb.input_ids)
        self.mirror.forward(self.name, fb, self.req_to_token_pool.req_to_token, last_only)
        # A decode batch has one row per request, so "last only" and "all rows" are the same.
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(fb):
            logits = self.cuda_graphs.replay(fb)
        elif self.verify_graphs is not None and not last_only and self.verify_graphs.can_run(fb):
            logits = self.verify_graphs.replay(fb)  # every row of k + 1 tokens per request
        elif self.extend_graphs is not None and last_only and self.extend_graphs.can_run(fb):
            logits = self.extend_graphs.replay(fb)  # each request's last row (left-padded batches)
        else:
            logits = self.model(fb, self.backend, fb.logit_rows(last_only))
        return logits if self.vocabulary is None else self.vocabulary.logits(logits)
