"""Draft trees: the ancestor mask, choosing N candidates, and exact acceptance; the batched device
form (drafting, selection, masks, acceptance) against the host reference."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specdecode_worker.engine.request import SamplingParams  # noqa: E402
from specdecode_worker.engine.speculation.tree import (  # noqa: E402
    DeviceTrees, DraftTree, TreeDrafter, TreeShape, accept_path, accept_trees, ancestor_mask, select_tree, tree_masks,
)


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


# ---- the batched device form against the host reference ------------------------------------------

def _host_draft(first_logits, step_logits, topk, steps, n):
    """The host expansion, one request: each step expands the k best of the previous step's
    children in (score desc, index) order; then ``select_tree`` takes the n best candidates."""
    k = topk
    logp = torch.log_softmax(first_logits, -1)
    top = torch.topk(logp, k)
    tok, score, par, depth = top.indices.tolist(), top.values.tolist(), [-1] * k, [1] * k
    frontier = list(range(k))
    for step in range(1, steps):
        top = torch.topk(torch.log_softmax(step_logits[step - 1], -1), k)
        base = len(tok)
        for j, parent in enumerate(frontier):
            tok += top.indices[j].tolist()
            score += [score[parent] + v for v in top.values[j].tolist()]
            par += [parent] * k
            depth += [step + 1] * k
        new = list(range(base, len(tok)))
        frontier = sorted(new, key=lambda x: (-score[x], x))[:k]
    return tok, score, par, depth


@pytest.mark.parametrize("topk,steps,n", [(3, 3, 6), (2, 4, 7), (4, 1, 3)])
def test_device_trees_equal_the_host_selection(topk, steps, n):
    g = torch.Generator().manual_seed(topk * 10 + steps)
    batch, vocab = 3, 11
    first = torch.randn(batch, vocab, generator=g) * 2
    step_logits = [torch.randn(batch * topk, vocab, generator=g) * 2 for _ in range(steps - 1)]
    drafter = TreeDrafter(TreeShape(topk, steps, n), first)
    for step, logits in enumerate(step_logits, start=1):
        drafter.step_mask(step)
        drafter.expand(logits)
    roots = torch.tensor([7, 8, 9])
    trees = drafter.select(roots)
    for b in range(batch):
        per_step = [lg.view(batch, topk, vocab)[b] for lg in step_logits]
        tok, score, par, depth = _host_draft(first[b], per_step, topk, steps, n)
        want = select_tree(int(roots[b]), tok, par, score, depth, n)
        assert trees.tokens[b].tolist() == want.tokens
        assert trees.parents[b].tolist() == [0] + want.parents[1:]  # the root is its own parent here
        assert trees.depths[b].tolist() == want.depths
        assert torch.equal(trees.mask[b], ancestor_mask(want.parents))


def test_step_masks_show_each_expanded_node_its_expanded_ancestors():
    # top-2, 3 steps: step 1 expands the root's children (scratch 0, 1), step 2 the best two
    # grandchildren (scratch 2, 3), each seeing itself and the scratch slot of its parent.
    first = torch.tensor([[0.0, 5.0, 4.0, -9.0]])
    drafter = TreeDrafter(TreeShape(2, 3, 4), first)
    assert drafter.step_mask(1).tolist() == [[[1, 0, 0, 0], [0, 1, 0, 0]]]
    assert drafter.frontier_tokens().tolist() == [[1, 2]]
    # Scores (log p along the path): token 1 -0.32, token 2 -1.32; under token 1, token 2 scores
    # -0.32 - 0.55, tokens 0 and 1 -0.32 - 1.55; under token 2, token 3 scores -1.32 - 0.00.
    logits = torch.tensor([[0.0, 0.0, 1.0, -9.0], [-9.0, -9.0, -9.0, 9.0]])
    came_from = drafter.expand(logits)
    assert came_from.tolist() == [[0, 1]] and drafter.frontier_tokens().tolist() == [[2, 3]]
    assert drafter.step_mask(2).tolist() == [[[1, 0, 1, 0], [0, 1, 0, 1]]]


def _random_tree(g, n, topk):
    parents, kids = [-1], [0]
    for i in range(1, n):
        options = [p for p in range(i) if kids[p] < topk]
        p = options[int(torch.randint(len(options), (1,), generator=g))]
        parents.append(p)
        kids[p] += 1
        kids.append(0)
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    return parents, depths


def _device(trees, vocab, g, depth):
    tokens = torch.stack([torch.randperm(vocab, generator=g)[: len(t[0])] for t in trees])
    parents = torch.tensor([[0] + t[0][1:] for t in trees])
    depths = torch.tensor([t[1] for t in trees])
    return DeviceTrees(tokens, parents, depths, tree_masks(parents, depth))


def test_device_greedy_acceptance_equals_the_host_walk():
    g = torch.Generator().manual_seed(5)
    batch, n, vocab, topk = 16, 7, 8, 3
    shapes = [_random_tree(g, n, topk) for _ in range(batch)]
    depth = max(max(d) for _, d in shapes)
    trees = _device(shapes, vocab, g, depth)
    logits = torch.randn(batch * n, vocab, generator=g)
    # the target's argmax follows a node's child often, so paths of several nodes are accepted
    for b in range(batch):
        for i in range(n):
            kids = [j for j in range(1, n) if shapes[b][0][j] == i]
            if kids and torch.rand((), generator=g) < 0.8:
                logits[b * n + i, trees.tokens[b, kids[-1]]] += 10
    ks = torch.randint(0, n, (batch,), generator=g)
    valid = torch.arange(n)[None] <= ks[:, None]
    count, nxt, path = accept_trees(trees, TreeShape(topk, depth, n - 1), valid, logits, [SamplingParams()] * batch,
                                    None)
    longest = 0
    for b in range(batch):
        k = int(ks[b])
        host = DraftTree(trees.tokens[b, : k + 1].tolist(), shapes[b][0][: k + 1], shapes[b][1][: k + 1])
        want_path, want_next = accept_path(host, logits[b * n : b * n + k + 1], SamplingParams(), None)
        assert (int(count[b]), int(nxt[b])) == (len(want_path), want_next)
        assert path[b, : count[b] + 1].tolist() == [0] + want_path
        longest = max(longest, len(want_path))
    assert longest >= 2


def test_device_sampled_acceptance_emits_the_target_distribution():
    """As for the host walk: the first emitted token follows q whatever the children are."""
    n = 20000
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    shape = TreeShape(2, 1, 2)  # the root proposes tokens 1 and 2
    trees = DeviceTrees(torch.tensor([[0, 1, 2]]).repeat(n, 1), torch.tensor([[0, 0, 0]]).repeat(n, 1),
                        torch.tensor([[0, 1, 1]]).repeat(n, 1), tree_masks(torch.tensor([[0, 0, 0]]).repeat(n, 1), 1))
    logits = q.log().repeat(n * 3, 1)
    u = torch.rand(n, shape.steps * shape.topk + 1, generator=torch.Generator().manual_seed(1))
    valid = torch.ones(n, 3, dtype=torch.bool)
    count, nxt, path = accept_trees(trees, shape, valid, logits, [SamplingParams(temperature=1.0)] * n, u)
    first = torch.where(count > 0, trees.tokens.gather(1, path[:, 1:2]).squeeze(1), nxt)
    counts = torch.bincount(first, minlength=4).float()
    expected = q * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3, (counts, chi2)  # p = 0.001 at 3 degrees of freedom
    assert set(count.tolist()) == {0, 1}  # both outcomes occur


def test_device_sampled_acceptance_follows_the_target_below_an_accepted_node():
    """Two levels: after the root's child 1 is accepted, the next token (node 1's children tried,
    or the residual drawn) follows node 1's own q; after child 2 (no children), node 2's q."""
    n = 40000
    q = torch.tensor([[0.1, 0.3, 0.4, 0.2], [0.25, 0.15, 0.2, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25] * 4, [0.25] * 4])
    shape = TreeShape(2, 2, 4)
    parents = torch.tensor([[0, 0, 0, 1, 1]]).repeat(n, 1)  # the root proposes 1, 2; node 1 proposes 3, 0
    trees = DeviceTrees(torch.tensor([[0, 1, 2, 3, 0]]).repeat(n, 1), parents,
                        torch.tensor([[0, 1, 1, 2, 2]]).repeat(n, 1), tree_masks(parents, 2))
    u = torch.rand(n, shape.steps * shape.topk + 1, generator=torch.Generator().manual_seed(2))
    count, nxt, path = accept_trees(trees, shape, torch.ones(n, 5, dtype=torch.bool), q.log().repeat(n, 1),
                                    [SamplingParams(temperature=1.0)] * n, u)
    tokens = trees.tokens.gather(1, path[:, 1:3])
    first = torch.where(count > 0, tokens[:, 0], nxt)
    second = torch.where(count > 1, tokens[:, 1], nxt)
    for node, token in ((1, 1), (2, 2)):
        after = second[(count > 0) & (first == token)]
        counts = torch.bincount(after, minlength=4).float()
        expected = q[node] * after.numel()
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 16.3, (node, counts, chi2)
