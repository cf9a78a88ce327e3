"""The one draft-compatibility rule the planner and the worker share (no torch import).

A draft that proposes token ids must read them the way the target does: same tokenizer. Config
``vocab_size`` values are not that test: they are often padded differently for one tokenizer (the
Qwen2.5 family pads 151,665 ids to 152,064 for 7B and up and to 151,936 below). So with a
``tokenizer.json`` in both folders their token counts are compared; without one, the configs'
vocab sizes must be equal.

What a compatible pair serves: the draft proposes only ids both heads have (below
``proposable_ids``, the smaller padded size); rows
only the target has are never proposed, and verification still reads the target's whole
distribution.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from .model_config import ModelShape


def token_count(tokenizer: Path) -> int | None:
    """Number of token ids a tokenizer.json defines (vocabulary plus added tokens), or None."""
    if not tokenizer.is_file():
        return None
    try:
        data = json.loads(tokenizer.read_text())
        vocab = data["model"]["vocab"]
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [t["id"] for t in data.get("added_tokens") or []]
        return max(ids) + 1 if ids else 0
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{tokenizer}: not a readable tokenizer.json ({exc})") from None


@dataclass(frozen=True)
class SharedVocabulary:
    """What a compatible draft/target pair agrees on."""

    target_vocab_size: int  # rows of the target's lm_head (padded)
    draft_vocab_size: int  # rows of the draft's lm_head (padded)
    proposable_ids: int  # the draft proposes ids in [0, proposable_ids): rows both heads have


def check_vocabulary(target_dir: Path, draft_dir: Path, target: ModelShape, draft: ModelShape) -> SharedVocabulary:
    """Accept the pair exactly when the tokenizers agree; raise InputError naming the files otherwise."""
    target_dir, draft_dir = Path(target_dir), Path(draft_dir)
    t_count, d_count = token_count(target_dir / "tokenizer.json"), token_count(draft_dir / "tokenizer.json")
    if t_count is not None and d_count is not None:
        if t_count != d_count:
            raise InputError(
                f"{draft_dir / 'tokenizer.json'}: defines {d_count} token ids but the target's "
                f"{target_dir / 'tokenizer.json'} defines {t_count}; a STANDALONE draft must use the target's tokenizer"
            )
        return SharedVocabulary(target.vocab_size, draft.vocab_size, min(target.vocab_size, draft.vocab_size))
    if target.vocab_size != draft.vocab_size:
        raise InputError(
            f"{draft.path}: field 'vocab_size' is {draft.vocab_size} but the target's "
            f"{target.path} has {target.vocab_size}; a STANDALONE draft must use the target's tokenizer "
            "(with tokenizer.json in both folders, differently padded vocabularies of one tokenizer are accepted)"
        )
    return SharedVocabulary(target.vocab_size, draft.vocab_size, target.vocab_size)
