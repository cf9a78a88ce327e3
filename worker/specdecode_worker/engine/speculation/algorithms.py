"""The served algorithms, each declared once: what drafts, what it reads, and what it expects.

Everything else asks these declarations (``algorithm(name).drafter``, ``.feature_layers``, ...)
instead of comparing names; ``wiring`` turns a declaration into runners and a speculator.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ...contract import SERVED_ALGORITHMS
from ...errors import InputError


class Drafter(Enum):
    """What proposes a round's tokens."""

    NONE = "nothing: plain decoding"
    LOOKUP = "a lookup in the request's own tokens (no pass)"
    MODEL = "a separate draft model with its own KV cache"
    HEAD = "an EAGLE head over the target's hidden states"
    NEXTN = "the target checkpoint's NextN layer over the target's hidden states"


DRAFT_NAMES = {Drafter.MODEL: "draft model", Drafter.HEAD: "EAGLE head", Drafter.NEXTN: "NextN layer"}


@dataclass(frozen=True)
class Algorithm:
    name: str
    drafter: Drafter
    # Target hidden states per token the drafter reads (EAGLE3 concatenates three layers).
    feature_layers: int = 0
    # First-position acceptance the adaptive policy expects before any evidence.
    prior: float = 0.5

    @property
    def drafts(self) -> bool:
        return self.drafter is not Drafter.NONE

    @property
    def needs_draft_folder(self) -> bool:
        return self.drafter in (Drafter.MODEL, Drafter.HEAD)

    @property
    def takes_draft_folder(self) -> bool:
        """MTP's NextN layer is the target's own; --draft may still name another folder holding it."""
        return self.needs_draft_folder or self.drafter is Drafter.NEXTN

    @property
    def reads_target_features(self) -> bool:
        return self.feature_layers > 0

    @property
    def draft_name(self) -> str | None:
        """The drafting model, in words (None: no model drafts)."""
        return DRAFT_NAMES.get(self.drafter)


ALGORITHMS = {a.name: a for a in (
    Algorithm("NONE", Drafter.NONE),
    Algorithm("NGRAM", Drafter.LOOKUP, prior=0.5),
    Algorithm("STANDALONE", Drafter.MODEL, prior=0.7),
    Algorithm("EAGLE", Drafter.HEAD, feature_layers=1, prior=0.7),
    Algorithm("EAGLE3", Drafter.HEAD, feature_layers=3, prior=0.75),
    Algorithm("MTP", Drafter.NEXTN, feature_layers=1, prior=0.75),
)}
assert tuple(sorted(ALGORITHMS)) == tuple(sorted(SERVED_ALGORITHMS)), "every served algorithm is declared once"


def algorithm(name: str) -> Algorithm:
    """The declaration of ``name``; a name this engine does not serve is the user's to fix."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise InputError(f"--algorithm {name}: this engine serves {', '.join(SERVED_ALGORITHMS)}") from None
