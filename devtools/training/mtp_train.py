"""A tiny DeepSeek-V3 with an MTP layer trained here (self-distillation on CPU), for the MTP benchmark.

The target is random (devtools/deepseek_models.py, the tests' geometry but larger); its NextN layer is
trained to predict the target's own greedy token two positions ahead from (the next token, the
target's final hidden state), exactly the draft step the engine runs. transformers' own
DeepSeek-V3 decoder layer is the trainable block; the trained layer is written back into the
checkpoint under the published names. A random NextN layer would accept almost nothing; this one
shows what MTP drafting does with a layer that has learnt the target.

Run:  python devtools/training/mtp_train.py [--steps 300]   # writes ~/.cache/specdecode/models/tiny-deepseek-v3-mtp
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from devtools.deepseek_models import write_tiny_deepseek  # noqa: E402
from devtools.smollm2 import cache_dir  # noqa: E402

# Larger than the tests' tiny model, so a draft step costs visibly less than a target pass.
GEOMETRY = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=6,
                num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16, num_experts_per_tok=4,
                n_group=4, topk_group=2, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16,
                v_head_dim=16, vocab_size=256, max_position_embeddings=1024,
                rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                 "rope_theta": 10000.0})
SEQ, PROMPT = 48, 8


def model_dir() -> Path:
    return cache_dir() / "tiny-deepseek-v3-mtp"


def random_sequences(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 130, (n, SEQ), generator=g)


def greedy_sequences(hf, n: int, seed: int) -> torch.Tensor:
    """Greedy continuations of random prompts: what the target says when served (held-out check)."""
    prompts = random_sequences(n, seed)[:, :PROMPT]
    with torch.no_grad():
        return hf.generate(prompts, max_new_tokens=SEQ - PROMPT, min_new_tokens=SEQ - PROMPT, do_sample=False)


class Trainable(torch.nn.Module):
    """enorm, hnorm, eh_proj, the decoder block and shared_head.norm, over transformers' modules."""

    def __init__(self, config, tensors: dict[str, torch.Tensor]):
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

        super().__init__()
        L, h = config.num_hidden_layers, config.hidden_size
        p = f"model.layers.{L}."
        self.enorm = ds.DeepseekV3RMSNorm(h, config.rms_norm_eps)
        self.hnorm = ds.DeepseekV3RMSNorm(h, config.rms_norm_eps)
        self.head_norm = ds.DeepseekV3RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.block = ds.DeepseekV3DecoderLayer(config, L)
        self.rotary = ds.DeepseekV3RotaryEmbedding(config)
        state = {k[len(p):]: v for k, v in tensors.items() if k.startswith(p) and ".experts." not in k}
        experts = range(config.n_routed_experts)
        state["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{p}mlp.experts.{j}.{w}_proj.weight"] for w in ("gate", "up")]) for j in experts])
        state["mlp.experts.down_proj"] = torch.stack([tensors[f"{p}mlp.experts.{j}.down_proj.weight"] for j in experts])
        self.block.load_state_dict(state, strict=False)  # the random layer the checkpoint carries
        with torch.no_grad():
            self.eh_proj.weight.copy_(tensors[p + "eh_proj.weight"])
            self.enorm.weight.copy_(tensors[p + "enorm.weight"])
            self.hnorm.weight.copy_(tensors[p + "hnorm.weight"])
            self.head_norm.weight.copy_(tensors[p + "shared_head.norm.weight"])
        self.prefix, self.config = p, config

    def forward(self, embedded, hidden):
        n = embedded.shape[1]
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], -1))
        positions = torch.arange(n)[None].expand(x.shape[0], -1)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        x = self.block(x, attention_mask=mask, position_ids=positions, position_embeddings=self.rotary(x, positions))
        return self.head_norm(x)

    def published(self) -> dict[str, torch.Tensor]:
        """The trained layer under the checkpoint's names (per-expert tensors, as released)."""
        p, out = self.prefix, {}
        out[p + "enorm.weight"], out[p + "hnorm.weight"] = self.enorm.weight, self.hnorm.weight
        out[p + "shared_head.norm.weight"], out[p + "eh_proj.weight"] = self.head_norm.weight, self.eh_proj.weight
        for name, t in self.block.state_dict().items():
            if name == "mlp.experts.gate_up_proj":
                m = self.config.moe_intermediate_size
                for j in range(t.shape[0]):
                    out[f"{p}mlp.experts.{j}.gate_proj.weight"] = t[j, :m]
                    out[f"{p}mlp.experts.{j}.up_proj.weight"] = t[j, m:]
            elif name == "mlp.experts.down_proj":
                for j in range(t.shape[0]):
                    out[f"{p}mlp.experts.{j}.down_proj.weight"] = t[j]
            else:
                out[p + name] = t
        return {k: v.detach().clone().contiguous() for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, DeepseekV3ForCausalLM

    out = model_dir()
    if out.exists():
        import shutil

        shutil.rmtree(out)
    write_tiny_deepseek(out, mtp=True, weight_scale=3.0, **GEOMETRY)
    tensors = load_file(out / "model.safetensors")
    config = AutoConfig.from_pretrained(out)
    hf = DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    start = time.perf_counter()
    # Training reads random contexts labelled with the target's own argmax (one teacher-forced pass);
    # the held-out check reads greedy continuations, the inputs the layer sees when served.
    train, held_out = random_sequences(256, 0), greedy_sequences(hf, 4, 1)
    with torch.no_grad():
        feats, labels = {}, {}
        for name, seqs in (("train", train), ("held", held_out)):
            feats[name] = hf.model(seqs).last_hidden_state
            labels[name] = hf(seqs).logits.argmax(-1)
    print(f"target passes: {time.perf_counter() - start:.0f}s")
    embed = tensors["model.embed_tokens.weight"]
    model = Trainable(config, tensors).float()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def batch(name, rows):
        # Position i reads token i+1 and the target's hidden at i; it must predict the target's
        # argmax after token i+1 (the token verification compares the proposal with).
        seqs, hidden = (train, held_out)[name == "held"][rows], feats[name][rows]
        return embed[seqs[:, 1:-1]], hidden[:, :-2], labels[name][rows][:, 1:-1]

    def logits_of(h):
        return h @ tensors["lm_head.weight"].T

    g = torch.Generator().manual_seed(2)
    for step in range(args.steps):
        rows = torch.randint(0, train.shape[0], (16,), generator=g)
        e, h, y = batch("train", rows)
        loss = torch.nn.functional.cross_entropy(logits_of(model(e, h)).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 20 == 0 or step == args.steps - 1:
            with torch.no_grad():
                e, h, y = batch("held", slice(None))
                acc = (logits_of(model(e, h)).argmax(-1) == y).float().mean()
            print(f"step {step}: loss {loss.item():.3f}, held-out next-next accuracy {acc.item():.2f}")
    tensors.update(model.published())
    L = config.num_hidden_layers
    tensors[f"model.layers.{L}.embed_tokens.weight"] = embed.clone()
    tensors[f"model.layers.{L}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    print(f"wrote {out} ({time.perf_counter() - start:.0f}s)")


if __name__ == "__main__":
    main()
