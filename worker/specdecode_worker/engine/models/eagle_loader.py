"""Loading an EAGLE / EAGLE3 head checkpoint as published, and checking it against its target.

Published heads keep a plain Llama ``config.json`` (``num_hidden_layers`` usually 1, optional
``draft_vocab_size``, ``target_hidden_size`` and ``eagle_config``) and their weights in
safetensors or ``pytorch_model.bin``; the latter is read with ``weights_only=True`` so a pickle
cannot run code. Names come as ``fc.weight``, ``layers.0.*`` or ``midlayer.*`` (EAGLE3), with or
without a ``model.`` prefix.

Shared tensors, as the planner (``checkpoint.split_target_draft``) prices them: the embedding is
always the target's, the lm_head too for EAGLE; a copy in the head's checkpoint is skipped, so
the target's tensors are resident once. Everything else the checkpoint holds is the head's own
(EAGLE3's lm_head, ``d2t`` and ``t2d`` included).

Under tensor parallelism each rank keeps its shard of every tensor the head shards
(``models.eagle``), cut from the whole tensor after the checks against the full shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import InputError
from ...model_rules.eagle_rule import aux_layer_ids
from ...model_rules.model_config import read_config
from ..parallel.group import SINGLE, TPGroup
from ..parallel.parallel_layers import take_shard
from .eagle import Eagle3Head, EagleHead

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedHead:
    head: torch.nn.Module
    # EAGLE3: target layer indices whose input hidden states the head reads (len(layers) = the
    # last layer's output); EAGLE: None (it reads the final-normed last hidden state).
    aux_layers: list[int] | None
    skipped_shared: list[str]  # names found in the checkpoint and served by the target instead


def _normalise(name: str) -> str:
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("midlayer."):
        name = "layers.0." + name[len("midlayer."):]
    return name


def read_head_tensors(model_dir: str | Path) -> tuple[dict[str, torch.Tensor], str]:
    """Every tensor of the head (normalised names) and the file(s) they came from."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    if files:
        from safetensors import safe_open

        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensors[_normalise(name)] = f.get_tensor(name)
        return tensors, ", ".join(str(f) for f in files)
    bins = sorted(model_dir.glob("pytorch_model*.bin"))
    if not bins:
        raise InputError(f"{model_dir}: no *.safetensors or pytorch_model.bin; an EAGLE head needs its weights")
    for file in bins:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # a pickle with code, or a corrupt file
            raise InputError(f"{file}: cannot be read as plain tensors (weights_only=True): {exc}") from None
        if not isinstance(state, dict):
            raise InputError(f"{file}: holds a {type(state).__name__}, not a name -> tensor dict")
        for name, t in state.items():
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{file}: entry '{name}' is a {type(t).__name__}, not a tensor")
            tensors[_normalise(name)] = t
    return tensors, ", ".join(str(b) for b in bins)


def head_config(raw: dict):
    from transformers import LlamaConfig

    cfg = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "auto_map")}
    return LlamaConfig(**cfg)


def load_eagle_head(
    model_dir: str | Path,
    algorithm: str,
    feature_layers: int,
    target_hidden_size: int,
    target_vocab_size: int,
    target_num_layers: int,
    device,
    dtype: torch.dtype,
    tp: TPGroup = SINGLE,
) -> LoadedHead:
    model_dir = Path(model_dir)
    # EAGLE3 heads read three target layers through a wider fc, with a vocabulary of their own;
    # EAGLE-1/2 heads read one and use the target's lm_head.
    eagle3 = feature_layers > 1
    where = str(model_dir / "config.json")
    raw = read_config(model_dir)
    config = head_config(raw)
    tensors, files = read_head_tensors(model_dir)
    tensors = {n: t for n, t in tensors.items() if not n.endswith(_IGNORED_SUFFIXES)}

    shared = ["embed_tokens.weight"] + ([] if eagle3 else ["lm_head.weight"])
    skipped = [n for n in shared if n in tensors]
    for n in skipped:
        del tensors[n]

    h = config.hidden_size
    if h != target_hidden_size:
        raise InputError(f"{where}: hidden_size {h} differs from the target's {target_hidden_size}; the head reads "
                         "the target's embedding 'model.embed_tokens.weight', so it must be trained for this target")
    if "fc.weight" not in tensors:
        raise InputError(f"{files}: tensor 'fc.weight' is missing; an {algorithm} head maps the target's hidden "
                         "states through fc (is this an EAGLE head checkpoint?)")
    if eagle3:
        if config.num_hidden_layers != 1:
            raise InputError(f"{where}: field 'num_hidden_layers' is {config.num_hidden_layers}; "
                             "an EAGLE3 head has 1 layer")
        th = raw.get("target_hidden_size") or target_hidden_size
        if th != target_hidden_size:
            raise InputError(f"{where}: field 'target_hidden_size' is {th} but the target's hidden_size is "
                             f"{target_hidden_size}")
        fc_in = feature_layers * target_hidden_size
        head_vocab = tuple(tensors["lm_head.weight"].shape)[0] if "lm_head.weight" in tensors else None
        _check_vocab_maps(tensors, raw, head_vocab, target_vocab_size, files, where)
        aux = aux_layer_ids(raw, target_num_layers, where)
    else:
        fc_in, head_vocab, aux = 2 * target_hidden_size, None, None
    if tuple(tensors["fc.weight"].shape) != (h, fc_in):
        raise InputError(
            f"{files}: tensor 'fc.weight' has shape {tuple(tensors['fc.weight'].shape)}; the target's hidden size "
            f"{target_hidden_size} needs ({h}, {fc_in}): the head was trained for a different target"
        )

    with torch.device("meta"):
        if eagle3:
            head = Eagle3Head(config, target_hidden_size, head_vocab, has_d2t="d2t" in tensors, tp=tp)
        else:
            head = EagleHead(config, fc_bias="fc.bias" in tensors,
                             first_input_norm="layers.0.input_layernorm.weight" in tensors, tp=tp)
        if "t2d" in tensors:  # kept (and priced by the planner) though decoding needs only d2t
            head.register_buffer("t2d", torch.empty(tensors["t2d"].shape, dtype=torch.bool))
    expected = dict(head.state_dict())
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise InputError(f"{files}: tensor '{unknown[0]}' has no place in an {algorithm} head "
                         f"({len(unknown)} unknown); is '{model_dir}' the right algorithm's head?")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise InputError(f"{files}: tensor '{missing[0]}' is missing ({len(missing)} missing) for an {algorithm} head "
                         f"with config {where}")
    params = dict(head.named_parameters())  # they carry the shard specs; state_dict() does not
    state = {}
    for name, ref in expected.items():
        t, full = take_shard(tensors[name], params.get(name, ref))
        if t is None:
            raise InputError(f"{files}: tensor '{name}' has shape {tuple(tensors[name].shape)}, "
                             f"config.json implies {full}")
        keep = ref.dtype if not ref.dtype.is_floating_point else dtype
        state[name] = t.to(device=device, dtype=keep)
    head.load_state_dict(state, strict=True, assign=True)
    head.rotary.reset(device)
    return LoadedHead(head.eval(), aux, skipped)


def _check_vocab_maps(tensors, raw, head_vocab, target_vocab, files, where) -> None:
    draft_vocab = raw.get("draft_vocab_size")
    if head_vocab is None:
        if "d2t" in tensors:
            raise InputError(f"{files}: tensor 'd2t' is given but 'lm_head.weight' is not; a reduced draft "
                             "vocabulary needs the head's own lm_head")
        return
    if draft_vocab is not None and draft_vocab != head_vocab:
        raise InputError(f"{files}: tensor 'lm_head.weight' has {head_vocab} rows but {where} says "
                         f"draft_vocab_size {draft_vocab}")
    if head_vocab != target_vocab or "d2t" in tensors:
        d2t = tensors.get("d2t")
        if d2t is None:
            raise InputError(f"{files}: tensor 'd2t' is missing; the head's lm_head covers {head_vocab} draft ids "
                             f"and d2t maps them to the target's {target_vocab}")
        if d2t.dim() != 1 or d2t.numel() != head_vocab or d2t.is_floating_point():
            raise InputError(f"{files}: tensor 'd2t' has shape {tuple(d2t.shape)} ({d2t.dtype}); it must hold one "
                             f"integer offset per draft id: ({head_vocab},)")
        ids = torch.arange(head_vocab) + d2t.long()
        if int(ids.min()) < 0 or int(ids.max()) >= target_vocab:
            raise InputError(f"{files}: tensor 'd2t' maps draft ids outside the target vocabulary [0, {target_vocab})")
    t2d = tensors.get("t2d")
    if t2d is not None and (t2d.dim() != 1 or t2d.numel() != target_vocab):
        raise InputError(f"{files}: tensor 't2d' has shape {tuple(t2d.shape)}; it marks each of the target's "
                         f"{target_vocab} ids: ({target_vocab},)")
