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

from ..sampler import batch_probs, block_index, draw, probs_from_logits, sample, sampled_blocks
from ..kernels.tree_attention import TreeForwardBatch
from ..request import SamplingParams


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


# ---- the batched device form ----------------------------------------------------------------------
# One round's trees for a whole batch as device tensors of static shapes, so drafting, the verify
# pass and acceptance queue work without reading anything back; the round's one read-back comes
# after acceptance (``batch_sampling.to_host``). The host functions above are the reference the
# tests hold these to.


@dataclass(frozen=True)
class TreeShape:
    """A deployment's tree: ``topk`` children per expanded node, ``steps`` draft steps (the tree's
    depth) and ``nodes`` verified proposals (the root excluded)."""

    topk: int
    steps: int
    nodes: int

    @property
    def candidates(self) -> int:
        return self.topk + (self.steps - 1) * self.topk * self.topk

    @property
    def scratch(self) -> int:
        """Expanded nodes, one draft K/V slot each: ``topk`` per step after the first."""
        return self.topk * (self.steps - 1)

    @property
    def width(self) -> int:
        """Rows per request in the verify pass: the root and the nodes."""
        return self.nodes + 1


@dataclass
class DeviceTrees:
    """``[B, width]`` each: node tokens (node 0: the root), parents (the root is its own), depths,
    and the ``[B, width, width]`` ancestor mask."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    mask: torch.Tensor


class TreeDrafter:
    """EAGLE-2 expansion for a batch, on the logits' device.

    Candidates are kept per request in ``[B, candidates]`` tensors in the order they are made
    (the root's children, then each step's children of the frontier), so a candidate's depth is a
    function of its index. Each step expands the frontier: the ``topk`` best candidates of the
    previous step (ties: the earlier one), in that order; they occupy draft scratch slots
    ``topk x (step - 1)`` onward, and ``ancestors`` records which scratch nodes each one sees.
    """

    def __init__(self, shape: TreeShape, logits: torch.Tensor):
        k, batch, device = shape.topk, logits.shape[0], logits.device
        self.shape = shape
        self.tokens = torch.zeros(batch, shape.candidates, dtype=torch.int64, device=device)
        self.scores = torch.zeros(batch, shape.candidates, dtype=torch.float32, device=device)
        self.parents = torch.full((batch, shape.candidates), -1, dtype=torch.int64, device=device)
        top = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)
        self.tokens[:, :k] = top.indices
        self.scores[:, :k] = top.values
        self.frontier = torch.arange(k, device=device).expand(batch, k).contiguous()
        self._parent_rows = None  # frontier rows of the previous step each frontier node came from
        self.filled = k
        self.ancestors = torch.zeros(batch, shape.scratch, shape.scratch, dtype=torch.bool, device=device)

    def frontier_tokens(self) -> torch.Tensor:
        return self.tokens.gather(1, self.frontier)

    def step_mask(self, step: int) -> torch.Tensor:
        """Register the frontier in its scratch slots; ``[B, topk, scratch]`` int8: the scratch
        nodes (ancestors and itself) each frontier node attends to at ``step`` (1-based)."""
        k = self.shape.topk
        rows = slice((step - 1) * k, step * k)
        if step > 1:
            parent_slots = (step - 2) * k + self._parent_rows
            index = parent_slots[..., None].expand(-1, -1, self.shape.scratch)
            self.ancestors[:, rows] = self.ancestors.gather(1, index)
        # each frontier node is its own ancestor: the diagonal of its rows (a view, no index tensor,
        # so no host value crosses to the device)
        self.ancestors[:, rows].diagonal(offset=rows.start, dim1=1, dim2=2).fill_(True)
        return self.ancestors[:, rows].to(torch.int8).contiguous()

    def expand(self, logits: torch.Tensor) -> torch.Tensor:
        """Add the children of the frontier (``logits``: ``[B x topk, V]``, the frontier's rows in
        order) and move the frontier to the best of them; returns, per new frontier node, the row of
        the frontier it came from (``[B, topk]``: whose draft feature it continues from)."""
        k, batch = self.shape.topk, self.tokens.shape[0]
        top = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)
        base = self.scores.gather(1, self.frontier)  # [B, k]
        scores = (base[:, :, None] + top.values.view(batch, k, k)).reshape(batch, k * k)
        span = slice(self.filled, self.filled + k * k)
        self.tokens[:, span] = top.indices.view(batch, k * k)
        self.scores[:, span] = scores
        self.parents[:, span] = self.frontier[:, :, None].expand(batch, k, k).reshape(batch, k * k)
        best = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
        self.frontier = self.filled + best
        self.filled += k * k
        self._parent_rows = torch.div(best, k, rounding_mode="floor")
        return self._parent_rows

    def select(self, roots: torch.Tensor) -> DeviceTrees:
        """The ``nodes`` best candidates under each request's root (``roots``: ``[B]`` tokens), in
        (score desc, depth, index) order: the order ``select_tree`` takes, so any prefix is a tree."""
        shape, batch, device = self.shape, self.tokens.shape[0], self.tokens.device
        n, k = shape.nodes, shape.topk
        chosen = torch.sort(self.scores, dim=1, descending=True, stable=True).indices[:, :n]  # [B, n]
        node_of = torch.zeros(batch, shape.candidates, dtype=torch.int64, device=device)
        node_of.scatter_(1, chosen, torch.arange(1, n + 1, device=device).expand(batch, n))
        cand_parent = self.parents.gather(1, chosen)
        parents = torch.where(cand_parent < 0, 0, node_of.gather(1, cand_parent.clamp(min=0)))
        index = torch.arange(shape.candidates, device=device)
        cand_depth = torch.where(index < k, 1, 2 + torch.div(index - k, k * k, rounding_mode="floor"))
        zero = torch.zeros(batch, 1, dtype=torch.int64, device=device)
        parents = torch.cat([zero, parents], dim=1)
        depths = torch.cat([zero, cand_depth[chosen]], dim=1)
        tokens = torch.cat([roots.reshape(batch, 1).to(torch.int64), self.tokens.gather(1, chosen)], dim=1)
        return DeviceTrees(tokens, parents, depths, tree_masks(parents, shape.steps))


def tree_step_batch(shape: TreeShape, drafter: TreeDrafter, kv: torch.Tensor, req_idx: torch.Tensor,
                    scratch: torch.Tensor, step: int, kv_lens: list[int]) -> TreeForwardBatch:
    """Draft inputs for expanding the frontier at ``step``: each node reads the prefix and its
    expanded ancestors (every scratch slot is a key; the mask hides those not yet written).
    ``scratch``: [B, shape.scratch] draft K/V slots; ``kv``/``kv_lens``: each request's length."""
    k, batch = shape.topk, len(kv_lens)
    # A node at depth d is the draft's input at position L + d - 1 (it predicts depth d + 1);
    # scratch slot j holds a node of depth j // k + 1.
    depth_of_slot = torch.div(torch.arange(shape.scratch, device=kv.device), k, rounding_mode="floor")
    return TreeForwardBatch(
        input_ids=drafter.frontier_tokens().reshape(-1),
        positions=(kv + step - 1).repeat_interleave(k),
        out_cache_loc=scratch[:, (step - 1) * k : step * k].reshape(-1),
        req_pool_indices=req_idx,
        seq_lens=kv + step,
        extend_lens=[k] * batch,
        seq_lens_cpu=[n + step for n in kv_lens],
        prefix_lens=kv, key_slots=scratch, key_positions=kv[:, None] + depth_of_slot[None, :],
        mask=drafter.step_mask(step), prefix_lens_cpu=list(kv_lens),
    )


def tree_verify_batch(trees: DeviceTrees, kv: torch.Tensor, req_idx: torch.Tensor, slots: torch.Tensor,
                      kv_lens: list[int]) -> TreeForwardBatch:
    """The target's pass over each request's root and nodes, under the tree's mask. ``slots``:
    [B, n] the target slots the nodes write, positions L.. of each request."""
    n = slots.shape[1]
    positions = kv[:, None] + trees.depths
    return TreeForwardBatch(
        input_ids=trees.tokens.reshape(-1), positions=positions.reshape(-1), out_cache_loc=slots.reshape(-1),
        req_pool_indices=req_idx, seq_lens=kv + n, extend_lens=[n] * len(kv_lens),
        seq_lens_cpu=[m + n for m in kv_lens], prefix_lens=kv, key_slots=slots, key_positions=positions,
        mask=trees.mask.to(torch.int8), prefix_lens_cpu=list(kv_lens),
    )


def tree_masks(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """``[B, n, n]`` bool ancestor masks from ``[B, n]`` parents (the root its own parent) of trees
    at most ``depth`` deep: node i sees j iff j is i or an ancestor (pointer jumping, no loop over n)."""
    batch, n = parents.shape
    mask = torch.zeros(batch, n, n, dtype=torch.bool, device=parents.device)
    node = torch.arange(n, device=parents.device).expand(batch, n)
    for _ in range(depth + 1):
        mask.scatter_(2, node[..., None], True)
        node = parents.gather(1, node)
    return mask


def accept_trees(trees: DeviceTrees, shape: TreeShape, valid: torch.Tensor, logits: torch.Tensor,
                 params: list[SamplingParams], u: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``accept_path`` for a batch on the device: (accepted counts ``[B]``, next tokens ``[B]``, the
    accepted path's nodes ``[B, steps + 1]`` from the root, valid up to count + 1).

    ``valid``: ``[B, n]``, the nodes request i verifies (a prefix of its node order). ``logits``:
    ``[B x n, V]``. ``u``: ``[B, steps x topk + 1]`` uniforms (None when every request is greedy):
    one per child tried, at depth d's child c slot ``d x topk + c``, then the next token's draw.
    """
    batch, n = trees.tokens.shape
    depth = shape.steps
    logits = logits.view(batch, n, -1)
    best = torch.argmax(logits, dim=-1)
    match = (trees.tokens == best.gather(1, trees.parents)) & valid
    match[:, 0] = True
    on = match
    for _ in range(depth):  # a node is on the path when it matches and its parent is on it
        on = match & on.gather(1, trees.parents)
    nxt = best.gather(1, _deepest(on, trees.depths)[:, None]).squeeze(1)
    if u is not None:  # sampling requests walk in blocks that bound the distributions' memory
        for block in sampled_blocks(params, logits.shape[-1], n):
            at = block_index(block, logits.device)
            part = DeviceTrees(trees.tokens[at], trees.parents[at], trees.depths[at], trees.mask[at])
            on[at], nxt[at] = _sampled_walk(part, shape, valid[at], logits[at], [params[i] for i in block], u[at])
    count = on.sum(1) - 1
    big = torch.full_like(trees.depths, n + depth + 1)
    path = torch.sort(torch.where(on, trees.depths, big), dim=1, stable=True).indices[:, : depth + 1]
    return count, nxt, path


def _deepest(on: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    return torch.argmax(torch.where(on, depths, -1), dim=1)


def _children(trees: DeviceTrees, valid: torch.Tensor, topk: int) -> torch.Tensor:
    """``[B, n, topk]``: each node's valid children in node order, -1 where there are fewer."""
    batch, n = trees.tokens.shape
    device = trees.tokens.device
    idx = torch.arange(n, device=device)
    real = valid & (idx > 0)
    earlier = (idx[None, :] < idx[:, None])[None] & real[:, None, :]
    rank = ((trees.parents[:, :, None] == trees.parents[:, None, :]) & earlier).sum(2)
    flat = torch.where(real, trees.parents * topk + rank, n * topk)  # invalid nodes: a spare column
    kids = torch.full((batch, n * topk + 1), -1, dtype=torch.int64, device=device)
    kids.scatter_(1, flat, idx.expand(batch, n).contiguous())
    return kids[:, : n * topk].view(batch, n, topk)


def _sampled_walk(trees: DeviceTrees, shape: TreeShape, valid: torch.Tensor, logits: torch.Tensor,
                  params: list[SamplingParams], u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``accept_path``'s recursive rejection, every request at once: at each depth the current
    node's children are tried in order, child c accepted with probability q(c) under the residual
    q, else q(c) is zeroed and q renormalised; no acceptance ends the path and the next token is
    drawn from the residual."""
    batch, n, vocab = logits.shape
    topk, depth = shape.topk, shape.steps
    device = logits.device
    q_all = batch_probs(logits.reshape(batch * n, vocab), [p for p in params for _ in range(n)]).view(batch, n, vocab)
    kids = _children(trees, valid, topk)
    rows = torch.arange(batch, device=device)
    node = torch.zeros(batch, dtype=torch.int64, device=device)
    q = q_all[:, 0].clone()
    on = torch.zeros(batch, n, dtype=torch.bool, device=device)
    on[:, 0] = True
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    for d in range(depth):
        moved = torch.zeros_like(done)
        node_kids = kids[rows, node]  # [B, topk]
        for c in range(topk):
            child = node_kids[:, c]
            active = ~done & ~moved & (child >= 0)
            child = child.clamp(min=0)
            token = trees.tokens[rows, child]
            accept = active & (u[:, d * topk + c] < q[rows, token])
            rejected = active & ~accept
            residual = q.scatter(1, token[:, None], 0.0)
            total = residual.sum(1, keepdim=True)
            residual = torch.where(total > 0, residual / total.clamp(min=1e-30), q_all[rows, node])
            q = torch.where(rejected[:, None], residual, q)
            node = torch.where(accept, child, node)
            q = torch.where(accept[:, None], q_all[rows, node], q)
            on[rows, child] |= accept
            moved |= accept
        done |= ~moved
    return on, draw(q, u[:, depth * topk])
