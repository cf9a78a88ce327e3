"""Draft trees: the ancestor mask, choosing N candidates, and exact acceptance."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specdecode_worker.engine.request import SamplingParams  # noqa: E402
from specdecode_worker.engine.tree import DraftTree, accept_path, ancestor_mask, select_tree  # noqa: E402


def test_ancestor_mask_by_hand():
    #      0
    #    1   2
    #    3     4
    mask = ancestor_mask([-1, 0, 0, 1, 2]).int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 0, 1, 0, 1],
    ]


def test_select_tree_keeps_the_best_and_their_ancestors():
    # Candidates: root children a(-0.1), b(-0.5); a's children c(-0.2), d(-1.0); b's child e(-0.6).
    tokens, parents = [10, 11, 12, 13, 14], [-1, -1, 0, 0, 1]
    scores, depths = [-0.1, -0.5, -0.2, -1.0, -0.6], [1, 1, 2, 2, 2]
    tree = select_tree(99, tokens, parents, scores, depths, 3)
    assert tree.tokens == [99, 10, 12, 11] and tree.parents == [-1, 0, 1, 0] and tree.depths == [0, 1, 2, 1]
    # A tie between parent and child: the parent comes first.
    tree = select_tree(99, [1, 2], [-1, 0], [0.0, 0.0], [1, 2], 2)
    assert tree.parents == [-1, 0, 1]


def test_greedy_acceptance_follows_the_target_argmax():
    tree = DraftTree([5, 1, 2, 3], [-1, 0, 0, 2], [0, 1, 1, 2])
    logits = torch.full((4, 6), -5.0)
    logits[0, 2] = 1  # root: the target wants 2 -> node 2
    logits[2, 3] = 1  # node 2: wants 3 -> node 3
    logits[3, 4] = 1  # node 3: wants 4, no such child -> next token 4
    assert accept_path(tree, logits, SamplingParams(), None) == ([2, 3], 4)


def test_sampled_acceptance_emits_the_target_distribution():
    """The first emitted token follows q whatever the children are (recursive rejection)."""
    tree = DraftTree([0, 1, 2], [-1, 0, 0], [0, 1, 1])  # the root proposes tokens 1 and 2
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = q.log().repeat(3, 1)
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.zeros(4)
    for _ in range(n):
        path, nxt = accept_path(tree, logits, params, gen)
        counts[tree.tokens[path[0]] if path else nxt] += 1
    expected = q * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3, (counts, chi2)  # p = 0.001 at 3 degrees of freedom
