"""Rounds drafted by a head that reads the target's features: an EAGLE or EAGLE3 head (a chain or
a tree), or an MTP model's NextN layer (a chain, as an EAGLE head's with top-k 1).

A round for a batch of requests (L: position of each request's last committed token, the one
neither model has cached; D: the first position the draft has not cached with target features):
1. draft extend over positions D..L-1: tokens D+1..L with the target's features of D..L-1; its
   last row proposes the first draft token(s) and the feature for the next step;
2. chain (top-k 1): k - 1 more single-token steps feed back the head's own feature;
   tree (top-k > 1): each step expands the k best nodes by their top-k children, then the N best
   candidates form the tree;
3. one target pass verifies the chain (causal) or the tree (tree mask) and captures features;
4. the accepted tokens' target slots take positions L.., the rest go back to the allocator; the
   accepted tokens' target features wait for the next round's extend (D = L), which rewrites the
   draft's K/V at those positions with target features, so its cache has no holes.

How each pass runs (a captured graph or eagerly, and mirrored to the other tensor-parallel ranks)
is ``head_passes.HeadPasses``'s; the round code here says only which pass it wants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..batch import Segment, chunk_segments, fresh_batch, make_batch, step_batch, with_cache_locs
from ..sampler import DraftGrammars, choose_tokens, ruled_tree, to_host, uniforms
from ..forward_batch import pack_to_device
from ..model_runner import ModelRunner
from ..request import Request
from . import algorithms
from .head_passes import HeadPasses
from .head_runner import EagleRunner, check_tree_args
from .rounds import Lookup, RoundResult, RoundRows, Speculator
from .tree import DeviceTrees, TreeDrafter, TreeShape, accept_trees, tree_step_batch, tree_verify_batch
from .verify import (accept_chains, chain_segments, emitted_logprobs, first_tokens, first_uniforms, ragged_ids,
                     record_prompt_logprobs, reserve_round, sample_next, verify_width, wants_prompt_rows)

if TYPE_CHECKING:
    from .mtp_runner import MTPRunner


class HeadSpeculator(Speculator):
    """EAGLE, EAGLE3 and MTP: the head drafts a chain or a tree from the target's features."""

    def __init__(self, algorithm: str, target_runner: ModelRunner, draft_runner: EagleRunner | MTPRunner,
                 num_steps: int, topk: int = 1, num_draft_tokens: int | None = None, chunk_tokens: int = 0):
        num_draft_tokens = num_steps if num_draft_tokens is None else num_draft_tokens
        check_tree_args(topk, num_steps, num_draft_tokens)
        self.chunk_tokens = chunk_tokens  # most tokens in one head pass catching up (chunkedPrefillSize); 0: no cap
        self.algorithm, self.method = algorithm, algorithms.algorithm(algorithm)
        self.target = target_runner
        self.draft = draft_runner
        self.num_steps, self.topk, self.k = num_steps, topk, num_draft_tokens
        self.tree = topk > 1
        self.tree_shape = TreeShape(topk, num_steps, num_draft_tokens)
        self.verified_per_request = num_draft_tokens if self.tree else None
        # most tokens a round leaves for the head's extend: its accepted proposals and the next one
        self.extend_width = (num_steps if self.tree else num_draft_tokens) + 1
        self.passes = HeadPasses(target_runner, draft_runner)
        self._features: dict[int, torch.Tensor] = {}  # rid -> target features not yet in the draft cache

    @property
    def slots_per_round(self) -> int:
        """Verify slots (last token + proposals), plus the tree's scratch slots for draft K/V."""
        scratch = self.topk * (self.num_steps - 1) if self.tree else 0
        return self.k + 1 + scratch

    @property
    def chain_verify_graphs(self):
        return self.passes.graphs.get(("target", self.k + 1))

    def target_pass(self, fb) -> None:
        self.passes.run_target(fb, "target")  # the speculator's graphs, as a round's target pass

    def capture_graphs(self, max_bs: int, eager: bool = False) -> None:
        """The graphs a round of this shape replays, by batch size up to ``max_bs`` (``HeadPasses.capture``)."""
        self.passes.capture(max_bs, eager, self.k, self.extend_width, self.tree_shape if self.tree else None)

    def replay(self, call: tuple) -> None:
        """A follower rank: run the eager pass rank 0 announced (``HeadPasses.replay``)."""
        self.passes.replay(call)

    def replay_graph(self, key: tuple[str, int], fb, extras) -> None:
        """A follower rank: replay the graph rank 0 announced (``HeadPasses.replay_graph``)."""
        self.passes.replay_graph(key, fb, extras)

    # ---- prefill ----------------------------------------------------------------------------
    def prefill(self, reqs: list[Request], ends: list[int]) -> list[RoundResult | None]:
        """Target features of every prefilled position wait for the head's first extend (D: where the
        prefill began, 0 or the end of the cached prefix whose head K/V the request reuses)."""
        segments = chunk_segments(reqs, ends)
        fb = fresh_batch(self.target.slots, segments, self.target.device)
        every_row = wants_prompt_rows(reqs)
        logits, features = self.passes.run_target(fb, "target", last_only=not every_row)
        if every_row:
            logits = record_prompt_logprobs(reqs, segments, logits)
        start = 0
        for r, s in zip(reqs, segments):
            chunk = features[start : start + len(s.tokens)]
            start += len(s.tokens)
            pending = self._features.get(r.rid)
            self._features[r.rid] = chunk if pending is None else torch.cat([pending, chunk])
        return first_tokens(reqs, ends, logits)

    def release(self, r: Request) -> None:
        self._features.pop(r.rid, None)

    # ---- one round ----------------------------------------------------------------------------
    def decode_round(self, reqs: list[Request], draft_lengths: list[int] | None = None,
                     lookup: Lookup | None = None) -> list[RoundResult]:
        """Request i verifies at most ``draft_lengths[i]`` tokens: the first ones of its chain, or
        the best-scored nodes of its tree (any prefix of that order is a tree). The head drafts
        for the whole batch; a round where no request drafts is a plain target step. (No
        ``lookup``: the head's drafts are made in the round.)"""
        ks = [self.k] * len(reqs) if draft_lengths is None else [min(k, self.k) for k in draft_lengths]
        if not any(ks):
            return self._plain_round(reqs)
        slots = self.target.slots
        # A tree's draft K/V scratch is taken before any work is queued, sent with the round's slots
        # and metadata in one copy, and given back from the host.
        scratch = slots.fresh(len(reqs) * self.tree_shape.scratch if self.tree else 0)
        try:
            rows, (scratch_d,) = reserve_round(slots, reqs, [self.k + 1] * len(reqs), ks, scratch)
            logits, hidden = self._draft_extend(reqs)
            if self.tree:
                return self._tree_round(reqs, logits, hidden, ks, rows, scratch_d.view(len(reqs), -1))
        finally:
            slots.give_back(scratch)
        return self._chain_round(reqs, logits, hidden, ks, rows)

    def _plain_round(self, reqs) -> list[RoundResult]:
        """One target step per request, its batch and fresh slots sent in one copy; its features
        join those the head has not read yet, so the next drafting round's extend catches the
        head's cache up over every skipped token."""
        segments = [Segment(r.req_idx, [r.all_ids[-1]], r.kv_len) for r in reqs]
        logits, features = self.passes.run_target(fresh_batch(self.target.slots, segments, self.target.device),
                                                   "target")
        for i, r in enumerate(reqs):
            self._features[r.rid] = torch.cat([self._features[r.rid], features[i : i + 1]])
        return sample_next(reqs, logits, list(range(len(reqs))), [r.kv_len + 1 for r in reqs])

    @torch.inference_mode()
    def _draft_extend(self, reqs):
        """The head over each request's tokens since its cache ends (with their target features):
        its logits and features at the last. A round's own (at most ``extend_width`` per request)
        replay the extend graphs, left-padded; longer ones run as they are. The head's cache then
        reaches each request's L (its round's result says so)."""
        cached = self._catch_up(reqs)
        segments = [Segment(r.req_idx, r.all_ids[d + 1 : r.kv_len + 1], d) for r, d in zip(reqs, cached)]
        hidden = torch.cat([self._features[r.rid] for r in reqs])
        return self.passes.extend(segments, hidden, self.extend_width)

    def _catch_up(self, reqs) -> list[int]:
        """When the head's pending positions (a prompt prefilled in chunks, or many rounds without
        drafting) exceed one chunk, extend it over all but each request's last pending position in
        passes of at most ``chunk_tokens`` tokens, as the target's prefill was; the round's own
        extend then reads one position per request. Returns each request's head cache length after."""
        cached = [r.draft_kv_len for r in reqs]
        chunk = self.chunk_tokens
        if not chunk or sum(r.kv_len - d for r, d in zip(reqs, cached)) <= chunk:
            return cached
        while True:
            budget, segments, hidden, taken = chunk, [], [], []
            for i, r in enumerate(reqs):
                d = cached[i]
                n = min(budget, r.kv_len - 1 - d)
                if n <= 0:
                    continue
                segments.append(Segment(r.req_idx, r.all_ids[d + 1 : d + 1 + n], d))
                hidden.append(self._features[r.rid][:n])
                taken.append((i, n))
                budget -= n
                if not budget:
                    break
            if not segments:
                return cached
            fb = with_cache_locs(make_batch(segments, self.draft.device), self.draft.req_to_token_pool, segments)
            self.passes.run_draft(fb, "draft", torch.cat(hidden), True, fb.logit_rows(True))  # only its K/V are kept
            for i, n in taken:
                cached[i] += n
                rid = reqs[i].rid
                self._features[rid] = self._features[rid][n:]

    def _chain_round(self, reqs, logits, hidden, ks, rows: RoundRows) -> list[RoundResult]:
        # Proposals stay on the device through the chain and the verify pass; one transfer at the end.
        device, params = self.target.device, [r.params for r in reqs]
        tokens = torch.zeros(len(reqs), self.k, dtype=torch.int64, device=device)
        probs = None
        grammars, every = DraftGrammars(reqs), list(range(len(reqs)))
        for step in range(self.k):
            token, p = choose_tokens(grammars.masked(logits, every), params, first_uniforms(reqs, 1, logits.device))
            grammars.advance(token, every)
            tokens[:, step] = token
            if p is not None:
                if probs is None:
                    probs = torch.zeros(len(reqs), self.k, p.shape[-1], device=device)
                probs[:, step] = p
            if step + 1 < self.k:  # built on the device from the round's rows: nothing sent
                fb = step_batch(self.draft.req_to_token_pool.req_to_token, rows.req_idx, rows.kv + step,
                                [r.kv_len + step for r in reqs], token)
                logits, hidden = self.passes.run_draft(fb, "draft", hidden, False, fb.logit_rows(False))

        slots = self.target.slots
        chains = torch.cat([rows.last[:, None], tokens], dim=1)
        width = verify_width(self.chain_verify_graphs, ks)
        if width:  # a graph's width for any mix of lengths (requests that do not draft: one valid row), or one length
            fb, padded = rows.verify_batch(slots.req_to_token, reqs, ks, chains, width)
        else:
            padded, segments = None, chain_segments(reqs, ks)
            fb = with_cache_locs(make_batch(segments, device), slots.rows, segments)
            fb.input_ids = ragged_ids(chains, ks)
        target_logits, features = self.passes.run_target(fb, "target")
        accepted, nexts, drafted, logprobs = accept_chains(reqs, tokens, probs, target_logits, ks, padded)
        results, start, rejected = [], 0, []
        for r, k, n, nxt, chain, lp in zip(reqs, ks, accepted, nexts, drafted, logprobs):
            verified = slice(start, start + k + 1)
            start += k + 1 if padded is None else padded.width
            last = r.kv_len
            rejected.append((r.req_idx, last + n + 1, last + self.k + 1))
            self._features[r.rid] = features[verified][: n + 1].clone()  # graph outputs are overwritten
            results.append(RoundResult(chain[:n] + [nxt], proposed=k, accepted=n, kv_len=last + n + 1,
                                       draft_kv_len=last, logprobs=lp))
        slots.release(rejected)
        return results

    def _tree_round(self, reqs, logits, hidden, ks, rows: RoundRows, scratch) -> list[RoundResult]:
        """Draft, verify and accept a tree per request on the device; one read-back at the end.
        ``scratch``: ``[B, scratch]`` each request's draft K/V slots for the expanded nodes, on the
        device (freed by the caller)."""
        shape = self.tree_shape
        k, batch = shape.topk, len(reqs)
        kv, req_idx = rows.kv, rows.req_idx
        drafter = TreeDrafter(shape, logits)
        front_hidden = hidden.repeat_interleave(k, dim=0)  # [B x k, H]: every root child's parent feature
        slots = scratch
        for step in range(1, shape.steps):
            fb = tree_step_batch(shape, drafter, kv, req_idx, slots, step, [r.kv_len for r in reqs])
            step_logits, step_hidden = self.passes.run_draft(fb, "draft_tree", front_hidden, False,
                                                             fb.logit_rows(False))
            came_from = drafter.expand(step_logits)
            width = step_hidden.shape[-1]
            front_hidden = step_hidden.view(batch, k, width).gather(
                1, came_from[..., None].expand(batch, k, width)).reshape(batch * k, width)
        trees = drafter.select(rows.last)
        return self._verify_trees(reqs, trees, ks, rows)

    def _verify_trees(self, reqs, trees: DeviceTrees, ks, rows: RoundRows) -> list[RoundResult]:
        shape, device = self.tree_shape, self.target.device
        n, batch = shape.width, len(reqs)
        kv_slots = self.target.slots
        rows_of = kv_slots.req_to_token
        # Every node, the first ks[i] proposals and the rest alike, is verified (static shapes); the
        # rest are left out of acceptance below.
        kv, req_idx = rows.kv, rows.req_idx
        slots = rows_of[req_idx[:, None], kv[:, None] + torch.arange(n, device=device)]  # [B, n]
        fb = tree_verify_batch(trees, kv, req_idx, slots, [r.kv_len for r in reqs])
        logits, features = self.passes.run_target(fb, "target_tree")
        valid = torch.arange(n, device=device)[None, :] < rows.lengths[:, None]  # the first ks[i] nodes, and the root
        params = [r.params for r in reqs]
        u = uniforms(params, [r.generator for r in reqs], shape.steps * shape.topk + 1, device)
        ruled = ruled_tree(reqs, logits, trees.tokens, trees.parents, trees.mask)  # logprobs read the raw rows
        count, nxt, path = accept_trees(trees, shape, valid, ruled, params, u)
        count, nxt, path, tokens, slot_ids = to_host(count, nxt, path, trees.tokens, slots)
        # The accepted path's nodes verified its tokens: node path[j] predicts the (j + 1)-th.
        emitted = [[tokens[i][x] for x in path[i][1: count[i] + 1]] + [nxt[i]] for i in range(batch)]
        logprobs = emitted_logprobs(reqs, logits, [[i * n + x for x in path[i][: count[i] + 1]] for i in range(batch)],
                                    emitted)
        # The accepted nodes' K/V become positions last..last+count (one write for the batch, sent
        # in one copy with the rows of their features); the other nodes' slots are freed.
        keeps = [path[i][: count[i] + 1] for i in range(batch)]
        rows, positions, kept_slots, feature_rows, rejected = [], [], [], [], []
        for i, (r, keep) in enumerate(zip(reqs, keeps)):
            rows += [r.req_idx] * len(keep)
            positions += range(r.kv_len, r.kv_len + len(keep))
            kept_slots += [slot_ids[i][x] for x in keep]
            feature_rows += [i * n + x for x in keep]
            kept = set(keep)
            rejected += [s for x, s in enumerate(slot_ids[i]) if x not in kept]
        rows_d, positions_d, kept_d, feature_rows_d = pack_to_device([rows, positions, kept_slots, feature_rows],
                                                                     device)
        rows_of[rows_d, positions_d] = kept_d
        kept_features = features.index_select(0, feature_rows_d).split([len(keep) for keep in keeps])
        results = []
        for i, (r, keep) in enumerate(zip(reqs, keeps)):
            self._features[r.rid] = kept_features[i]
            results.append(RoundResult(emitted[i], proposed=ks[i], accepted=count[i], kv_len=r.kv_len + len(keep),
                                       draft_kv_len=r.kv_len, logprobs=logprobs[i]))
        kv_slots.give_back(torch.tensor(rejected, dtype=torch.int64))
        return results
