"""Tiny random-weight checkpoints (Llama, Qwen2, Mistral) with a local tokenizer, for tests and demos.

Every file is what a real Hugging Face folder holds: config.json, model.safetensors written by
transformers' ``save_pretrained``, and a fast tokenizer built with ``tokenizers`` (no hub access).
"""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = (
    "the a an of to and in is it that was for on are as with his they at be this from i have or by one "
    "had not but what all were when we there can your which their said if do will each about how up out "
    "them then she many some so these would other into has more her two like him see time could no make "
    "than first been its who now people my made over did down only way find use may water long little "
    "very after words called just where most know capital france paris hello world yes cat dog red blue "
    "green number one two three four five six seven eight nine ten . , ? ! : user assistant system"
).split()
VOCAB = list(dict.fromkeys(SPECIALS + WORDS))
VOCAB_SIZE = 160  # room above len(VOCAB) so ids stay in range when words are added
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} : {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant : {% endif %}"
)


def write_tokenizer(out_dir: str | Path) -> Path:
    """A lower-casing word-level tokenizer over VOCAB; <|im_end|> ends a chat turn."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    assert len(VOCAB) <= VOCAB_SIZE
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", bos_token="<|endoftext|>",
        pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return out


def _config(arch: str, **kw):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=3, pad_token_id=1,
    )
    common.update(kw)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "mistral":
        common.setdefault("sliding_window", 16)
        return MistralConfig(**common)
    raise ValueError(f"unknown tiny architecture {arch!r}")


def write_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0, weight_scale: float = 1.0,
                     **config) -> Path:
    """Write a random ``arch`` checkpoint plus tokenizer into ``out_dir``; returns the folder.

    ``config`` overrides the tiny shape (hidden_size, num_hidden_layers, ...). ``weight_scale``
    multiplies the random init so that logits are peaked enough for greedy ties to be rare.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, **config), dtype=torch.float32)
    if weight_scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.mul_(weight_scale)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    return out


def write_tiny_pair(root: str | Path, arch: str = "llama") -> tuple[Path, Path]:
    """A target (2 layers, hidden 64) and a different, smaller random draft (1 layer, hidden 32)."""
    root = Path(root)
    target = write_tiny_model(root / f"{arch}-target", arch, seed=0, weight_scale=3.0)
    draft = write_tiny_model(
        root / f"{arch}-draft", arch, seed=1, weight_scale=3.0,
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
    )
    return target, draft
