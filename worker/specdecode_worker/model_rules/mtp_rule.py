"""Which MTP drafts are served: one rule for the planner and the worker (no torch import).

The worker drafts with DeepSeek-V3's NextN layer: exactly one layer (``num_nextn_predict_layers``
1, as DeepSeek-V3/R1/V3.1 publish), at any tensor parallelism that splits the target (the layer
shards with it). The planner refuses anything else first, so a planned MTP deployment is one the
worker starts.
"""

from __future__ import annotations

from ..errors import InputError
from .model_config import ModelShape

MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM",)


def check_mtp_draft(shape: ModelShape, where: str) -> None:
    """Refuse a model whose NextN layers this worker cannot draft with; ``where`` names its config.json."""
    nextn = shape.num_nextn_predict_layers
    if not nextn:
        raise InputError(f"{where}: field 'num_nextn_predict_layers' must be a positive integer for MTP, got "
                         f"{nextn!r}; the model has no MTP layers (use EAGLE/EAGLE3/STANDALONE/NGRAM)")
    if shape.architecture not in MTP_ARCHITECTURES:
        raise InputError(f"{where}: MTP drafting is served for {', '.join(MTP_ARCHITECTURES)}, not "
                         f"'{shape.architecture}'; use NGRAM or a STANDALONE draft")
    if nextn != 1:
        raise InputError(f"{where}: field 'num_nextn_predict_layers' is {nextn}; MTP drafting serves exactly one "
                         "NextN layer (as DeepSeek-V3/R1 publish)")


def check_standalone_draft(shape: ModelShape, where: str) -> None:
    """A model that carries NextN layers drafts for itself (MTP), not as a STANDALONE draft: its KV
    layer count and weights would be priced as a NextN draft's, not as the whole model's."""
    if shape.num_nextn_predict_layers:
        raise InputError(f"{where}: has MTP layers (num_nextn_predict_layers {shape.num_nextn_predict_layers}); "
                         "serve that model as the target with --algorithm MTP, or use a STANDALONE draft without "
                         "NextN layers")
