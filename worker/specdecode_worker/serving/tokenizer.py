"""What the served model's folder gives the front end: its tokenizer and its end-of-sequence ids."""

from __future__ import annotations

import json
from pathlib import Path


def load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer, or None when the folder has none (token-id prompts only)."""
    folder = Path(model_dir)
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def eos_ids(model_dir: str, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
