"""Draft trees: choosing the N best candidates, the tree attention mask, and accepting a path.

Candidates come from expanding the top-k children of the k best nodes per step (EAGLE-2). A
candidate's score is the sum of the draft's log-probabilities along its path, so a child never
scores above its parent; ordering by (score desc, depth asc) therefore lists every parent before
its children, and any prefix of that order is a tree. Node 0 is the root: the last committed
token, which the target has not cached yet.

Acceptance walks from the root. Greedy: follow the child whose token is the target's argmax.
Sampling: the children are point-mass proposals without replacement; child c is accepted with
probability q(c) under the current residual q, otherwise q(c) is zeroed and q renormalised; when
no child is accepted the next token is drawn from the residual. Each step's output then follows
the target's distribution exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import SamplingParams
from .sampling import probs_from_logits, sample


@dataclass
class DraftTree:
    tokens: list[int]  # node 0 = root
    parents: list[int]  # parents[0] = -1; parents[i] < i
    depths: list[int]

    @property
    def size(self) -> int:
        return len(self.tokens)

    def children(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], start=1):
            out[p].append(i)  # in node order: best-scored first
        return out

    def mask(self, device=None) -> torch.Tensor:
        """[n, n] bool: node i sees node j iff j is i or one of its ancestors."""
        return ancestor_mask(self.parents, device)


def ancestor_mask(parents: list[int], device=None) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros((n, n), dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
    return mask.to(device) if device is not None else mask


def select_tree(root: int, tokens: list[int], parents: list[int], scores: list[float], depths: list[int],
                n: int) -> DraftTree:
    """The ``n`` best candidates as a tree under ``root``.

    Candidate i has token ``tokens[i]``, parent candidate ``parents[i]`` (-1: the root), score and
    depth (1 for the root's children).
    """
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i], i))[:n]
    node_of = {}
    tree = DraftTree([root], [-1], [0])
    for c in order:
        p = parents[c]
        if p >= 0 and p not in node_of:
            raise AssertionError("a candidate was chosen before its parent")  # scores are non-increasing
        node_of[c] = tree.size
        tree.tokens.append(tokens[c])
        tree.parents.append(0 if p < 0 else node_of[p])
        tree.depths.append(depths[c])
    return tree


def accept_path(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator) -> tuple[list[int], int]:
    """Accepted nodes (root excluded, in order) and the next token; ``logits`` has a row per node."""
    children = tree.children()
    if params.greedy:
        best = torch.argmax(logits, dim=-1).tolist()
        node, path = 0, []
        while True:
            nxt = best[node]
            child = next((c for c in children[node] if tree.tokens[c] == nxt), None)
            if child is None:
                return path, nxt
            path.append(child)
            node = child
    q_all = probs_from_logits(logits, params)
    node, path = 0, []
    while True:
        q = q_all[node].clone()
        for c in children[node]:
            t = tree.tokens[c]
            if float(torch.rand((), generator=generator)) < float(q[t]):
                path.append(c)
                node = c
                break
            q[t] = 0
            total = float(q.sum())
            if total <= 0:  # every token of q was proposed and rejected: impossible unless q is 0
                q = q_all[node].clone()
                total = 1.0
            q = q / total
        else:
            return path, sample(q, generator)
