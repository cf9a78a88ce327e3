"""Causal LMs over the paged KV pools, chosen by the checkpoint's architecture."""

from __future__ import annotations

from ...errors import InputError
from .deepseek_v3 import DeepseekV3ForCausalLM
from .llama import LlamaForCausalLM

# Llama, Qwen2 (biased q/k/v) and Mistral (sliding window) share one implementation.
ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}


def model_class(architecture: str, where: str):
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise InputError(f"{where}: architecture '{architecture}' is not supported; use one of {supported}") from None
