"""Random EAGLE-1 and EAGLE3 head checkpoints laid out as the published ones are.

EAGLE-1 (SafeAILab ``cnets1``): ``fc`` (2H -> H, with bias), ``layers.N.*`` without
``layers.0.input_layernorm``, plus a copy of the target's ``embed_tokens.weight``.
EAGLE3 (``cnets``): ``fc`` (3H -> H), ``midlayer.*`` with ``hidden_norm`` and q/k/v over 2H,
``norm``, its own ``lm_head`` over a draft vocabulary, ``d2t`` offsets and the ``t2d`` mask.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _config(target_dir: Path, **kw) -> dict:
    t = json.loads((Path(target_dir) / "config.json").read_text())
    cfg = {k: t[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                             "rms_norm_eps", "vocab_size", "max_position_embeddings", "rope_theta") if k in t}
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1, torch_dtype="float32")
    cfg.update(kw)
    return cfg


def _layer(prefix: str, h: int, inter: int, heads: int, kv_heads: int, in_dim: int, g, scale: float,
           input_norm: bool, hidden_norm: bool) -> dict[str, torch.Tensor]:
    d = h // heads
    rnd = lambda *s: torch.randn(*s, generator=g) * scale / s[-1] ** 0.5  # noqa: E731
    out = {
        f"{prefix}self_attn.q_proj.weight": rnd(heads * d, in_dim),
        f"{prefix}self_attn.k_proj.weight": rnd(kv_heads * d, in_dim),
        f"{prefix}self_attn.v_proj.weight": rnd(kv_heads * d, in_dim),
        f"{prefix}self_attn.o_proj.weight": rnd(h, heads * d),
        f"{prefix}mlp.gate_proj.weight": rnd(inter, h),
        f"{prefix}mlp.up_proj.weight": rnd(inter, h),
        f"{prefix}mlp.down_proj.weight": rnd(h, inter),
        f"{prefix}post_attention_layernorm.weight": torch.ones(h),
    }
    if input_norm:
        out[f"{prefix}input_layernorm.weight"] = torch.ones(h)
    if hidden_norm:
        out[f"{prefix}hidden_norm.weight"] = torch.ones(h)
    return out


def _target_embedding(target_dir: Path) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(Path(target_dir) / "model.safetensors"), framework="pt") as f:
        return f.get_tensor("model.embed_tokens.weight")


def _save(out: Path, cfg: dict, tensors: dict[str, torch.Tensor], fmt: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if fmt == "bin":
        torch.save(tensors, out / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(tensors, str(out / "model.safetensors"))
    return out


def write_eagle_head(out: str | Path, target_dir: str | Path, seed: int = 0, layers: int = 1, scale: float = 2.0,
                     fmt: str = "safetensors", drop: tuple[str, ...] = (), **config) -> Path:
    cfg = _config(Path(target_dir), num_hidden_layers=layers, **config)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "fc.weight": torch.randn(h, 2 * h, generator=g) * scale / (2 * h) ** 0.5,
        "fc.bias": torch.randn(h, generator=g) * 0.1,
        "embed_tokens.weight": _target_embedding(Path(target_dir)),  # published heads carry a copy
    }
    for i in range(layers):
        tensors.update(_layer(f"layers.{i}.", h, inter, heads, kv, h, g, scale, input_norm=i > 0, hidden_norm=False))
    for name in drop:
        tensors.pop(name)
    return _save(Path(out), cfg, tensors, fmt)


def write_eagle3_head(out: str | Path, target_dir: str | Path, draft_vocab: int, seed: int = 0, scale: float = 2.0,
                      fmt: str = "safetensors", aux_layer_ids: list[int] | None = None,
                      d2t_len: int | None = None, fc_in: int | None = None, **config) -> Path:
    target_cfg = json.loads((Path(target_dir) / "config.json").read_text())
    vocab = target_cfg["vocab_size"]
    cfg = _config(Path(target_dir), draft_vocab_size=draft_vocab, **config)
    if aux_layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids, "use_aux_hidden_state": True}
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    g = torch.Generator().manual_seed(seed)
    # The draft vocabulary: a random subset of the target's ids in increasing order.
    kept = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
    d2t = kept - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    fc_in = fc_in or 3 * h
    tensors = {
        "fc.weight": torch.randn(h, fc_in, generator=g) * scale / fc_in ** 0.5,
        "norm.weight": torch.ones(h),
        "lm_head.weight": torch.randn(draft_vocab, h, generator=g) * scale / h ** 0.5,
        "d2t": d2t if d2t_len is None else torch.zeros(d2t_len, dtype=torch.int64),
        "t2d": t2d,
    }
    tensors.update(_layer("midlayer.", h, inter, heads, kv, 2 * h, g, scale, input_norm=True, hidden_norm=True))
    return _save(Path(out), cfg, tensors, fmt)


def make_repeating(target_dir: str | Path, layer_scale: float = 0.3, head_scale: float = 4.0) -> Path:
    """Turn a tiny target into one whose greedy output mostly repeats its last token.

    lm_head becomes a multiple of the embedding and the decoder layers shrink, so the residual
    stream keeps the current token's embedding on top; attention still nudges some steps.
    """
    from safetensors.torch import load_file, save_file

    path = Path(target_dir) / "model.safetensors"
    state = load_file(str(path))
    for name in state:
        if ".layers." in name and "norm" not in name:
            state[name] = state[name] * layer_scale
    state["lm_head.weight"] = state["model.embed_tokens.weight"] * head_scale
    save_file(state, str(path), metadata={"format": "pt"})
    return Path(target_dir)


def write_copying_eagle_head(out: str | Path, target_dir: str | Path, seed: int = 0, scale: float = 0.3,
                             gain: float = 30.0) -> Path:
    """An EAGLE-1 head whose output is about the embedding of its input token: it proposes
    "repeat the last token", which a repeating target accepts often, several tokens deep."""
    from safetensors.torch import load_file, save_file

    out = write_eagle_head(out, target_dir, seed=seed, scale=scale)
    state = load_file(str(out / "model.safetensors"))
    h = state["fc.weight"].shape[0]
    state["fc.weight"] = torch.cat([torch.eye(h) * gain, torch.zeros(h, h)], dim=1)
    state["fc.bias"] = torch.zeros(h)
    save_file(state, str(out / "model.safetensors"))
    return out
