"""A draft's vocabulary mapped onto the target's, for pairs that share a tokenizer but pad differently.

The draft reads and proposes ids of the shared tokenizer. Its logits keep the ids below
``proposable_ids`` (rows both heads have) and are widened (or cut) to the target's padded size
with -inf, so rows only the target has are never proposed and a draft distribution lines up with
the target's for rejection sampling.
"""

from __future__ import annotations

import torch

from ...model_rules.vocabulary import SharedVocabulary


class DraftVocabulary:
    def __init__(self, shared: SharedVocabulary):
        self.target_vocab_size = shared.target_vocab_size
        self.draft_vocab_size = shared.draft_vocab_size
        self.proposable_ids = shared.proposable_ids

    @property
    def is_identity(self) -> bool:
        return self.target_vocab_size == self.draft_vocab_size == self.proposable_ids

    def inputs(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids the draft can embed. A target padding id (never emitted by a trained target) reads as id 0:
        it only degrades that one proposal, and verification keeps the output exact."""
        return torch.where(ids < self.draft_vocab_size, ids, torch.zeros_like(ids))

    def logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[n, draft_vocab] -> [n, target_vocab]: the rows both heads have kept, every other column -inf."""
        out = draft_logits.new_full((draft_logits.shape[0], self.target_vocab_size), float("-inf"))
        out[:, : self.proposable_ids] = draft_logits[:, : self.proposable_ids]
        return out
