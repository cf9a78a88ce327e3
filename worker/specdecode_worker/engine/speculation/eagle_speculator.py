"""EAGLE / EAGLE3 speculative decoding: the draft head's runner and speculator, chain and tree rounds.

The head keeps the engine's three-step split: its runner's ``load_weights`` reads the head only
(the target's embedding and lm_head are borrowed, never copied); ``alloc_memory_pool`` adopts the
target's req_to_token pool and allocator and adds the head's own K/V buffers; ``init_backends``
sets up its attention backends.

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

Under tensor parallelism the head shards with the target (``models.eagle``). Rank 0 runs the
rounds; each target pass and head step it runs is announced to the other ranks with its batch,
the req_to_token rows it reads, and (head steps) the features, so every rank runs the same pass
on its shards and the collectives line up: a graph replay as a replay of the same graph with the
same staged inputs (``Mirror.graph``, ``replay_graph``), an eager pass as that pass
(``Mirror.call``, ``EagleSpeculator.replay``).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ...errors import InputError
from ...model_rules.model_config import load_shape, read_config
from ..batch import Segment, chunk_segments, fresh_batch, left_padded_batch, make_batch, step_batch, with_cache_locs
from ..batch_sampling import choose_tokens, to_host, uniforms
from ..cuda_graph import GraphRunner
from ..forward_batch import pack_to_device
from ..kernels.attention import make_attn_backend
from ..output_rules import DraftGrammars, ruled_tree
from ..kernels.tree_attention import make_tree_attn_backend
from ..model_runner import ModelRunner
from ..models.eagle_loader import head_config, load_eagle_head
from ..models.loader import tensor_bytes
from ..parallel.parallel_layers import check_splits, parallel_logits
from ..phases import Phase, PhaseError, require
from ..request import Request
from . import algorithms
from .speculative import (Lookup, RoundResult, RoundRows, Speculator, accept_chains, chain_segments,
                          emitted_logprobs, first_uniforms, ragged_ids, record_prompt_logprobs, reserve_round,
                          sample_next, verify_width, wants_prompt_rows)
from .tree import DeviceTrees, TreeDrafter, TreeShape, accept_trees, tree_step_batch, tree_verify_batch
from .tree_graph import TreeGraphInputs

log = logging.getLogger(__name__)


class HiddenCapture:
    """Collects, during a target forward, the hidden states a head reads (see LlamaForCausalLM)."""

    def __init__(self, aux_layers: list[int] | None):
        self.aux_layers = aux_layers
        self.aux: dict[int, torch.Tensor] = {}
        self.last: torch.Tensor | None = None

    def take(self, index: int, x: torch.Tensor, norm=None) -> None:
        if self.aux_layers is None:
            if norm is not None:
                self.last = norm(x)
        elif index in self.aux_layers:
            self.aux[index] = x

    def features(self) -> torch.Tensor:
        if self.aux_layers is None:
            return self.last
        return torch.cat([self.aux[i] for i in self.aux_layers], dim=-1)


class EagleRunner(ModelRunner):
    """The head on one device, sharded as the target is; phases 2 and 3 are ModelRunner's (the
    head's own K/V layers, ``max(1, kv / t)`` heads per rank)."""

    def __init__(self, model_dir: str, target_runner: ModelRunner, algorithm_name: str):
        method = algorithms.algorithm(algorithm_name)
        if method.drafter is not algorithms.Drafter.HEAD:
            raise ValueError(f"{algorithm_name} drafts with no EAGLE head")
        tp = target_runner.tp
        if tp.size > 1:  # the planner's rule: the head splits t ways as the target does
            check_splits(head_config(read_config(model_dir)), tp.size, f"{model_dir}/config.json")
        # config.json only (the layer count is known before any weight); dtypes are the target's.
        self._init_state(model_dir, "draft", target_runner.device, load_shape(model_dir), target_runner.dtype,
                         target_runner.kv_dtype, tp)
        self.algorithm, self.method = algorithm_name, method
        self.target = target_runner
        self.aux_layers: list[int] | None = None
        self.tree_backend = None  # set in phase 3

    def load_weights(self) -> None:
        if self.phase >= Phase.WEIGHTS_LOADED:
            raise PhaseError(f"{self.name}: weights are already loaded")
        require(self.target.phase, Phase.WEIGHTS_LOADED, "load an EAGLE head that shares the target's embedding",
                self.name)
        t = self.target.shape
        loaded = load_eagle_head(self.model_dir, self.method.name, self.method.feature_layers, t.hidden_size,
                                 t.vocab_size, t.num_hidden_layers, self.device, self.dtype, self.tp)
        self.model, self.aux_layers = loaded.head, loaded.aux_layers
        self.weight_bytes = tensor_bytes(self.model)  # shared tensors stay in the target's module
        if loaded.skipped_shared:
            log.info("%s: %s served by the target (checkpoint copy not loaded)", self.name,
                     ", ".join(loaded.skipped_shared))
        self.phase = Phase.WEIGHTS_LOADED
        log.info("%s: loaded %s head (%d weight bytes of its own)", self.name, self.algorithm, self.weight_bytes)

    def init_backends(self, cuda_graph_max_bs: int = 0) -> None:
        require(self.phase, Phase.POOLS_ALLOCATED, "initialise attention backends", self.name)
        self.backend = make_attn_backend(self.req_to_token_pool, self.token_to_kv_pool, None)
        self.tree_backend = make_tree_attn_backend(self.req_to_token_pool, self.token_to_kv_pool, None)
        log.info("%s: chain draft steps are graphed by the speculator where the backend allows", self.name)
        self.phase = Phase.BACKENDS_READY

def check_tree_args(topk: int, num_steps: int, num_draft_tokens: int) -> None:
    if topk < 1 or num_steps < 1 or num_draft_tokens < 1:
        raise InputError("EAGLE needs --speculative-eagle-topk, --speculative-num-steps and "
                         "--num-draft-tokens of at least 1")
    if topk == 1 and num_draft_tokens != num_steps:
        raise InputError(f"chain drafting (top-k 1) proposes one token per step: --num-draft-tokens "
                         f"({num_draft_tokens}) must equal --speculative-num-steps ({num_steps})")
    candidates = topk + (num_steps - 1) * topk * topk
    if topk > 1 and num_draft_tokens > candidates:
        raise InputError(f"a tree of top-k {topk} over {num_steps} steps has {candidates} candidates; "
                         f"--num-draft-tokens {num_draft_tokens} must not exceed that")


class EagleSpeculator(Speculator):
    """EAGLE and EAGLE3: the head drafts a chain or a tree from the target's features."""

    def __init__(self, algorithm: str, target_runner: ModelRunner, draft_runner: EagleRunner,
                 num_steps: int, topk: int = 1, num_draft_tokens: int | None = None, chunk_tokens: int = 0):
        num_draft_tokens = num_steps if num_draft_tokens is None else num_draft_tokens
        check_tree_args(topk, num_steps, num_draft_tokens)
        self.chunk_tokens = chunk_tokens  # most tokens in one head pass catching up (chunkedPrefillSize); 0: no cap
        self.algorithm, self.method = algorithm, algorithms.algorithm(algorithm)
        self.target = target_runner
        self.draft = draft_runner
        self.head = draft_runner.model
        self.num_steps, self.topk, self.k = num_steps, topk, num_draft_tokens
        self.tree = topk > 1
        self.tree_shape = TreeShape(topk, num_steps, num_draft_tokens)
        self.verified_per_request = num_draft_tokens if self.tree else None
        # most tokens a round leaves for the head's extend: its accepted proposals and the next one
        self.extend_width = (num_steps if self.tree else num_draft_tokens) + 1
        self.target_tree_backend = make_tree_attn_backend(target_runner.req_to_token_pool,
                                                          target_runner.token_to_kv_pool,
                                                          target_runner.model.sliding_window)
        self.embed = target_runner.model.model.embed_tokens
        self.tp = draft_runner.tp  # the target's group: heads and the MTP layer shard with it
        self.mirror = target_runner.mirror  # the group's other ranks run this speculator's passes too
        d2t = getattr(self.head, "d2t", None)
        self._draft_ids = None if d2t is None else torch.arange(d2t.numel(), device=d2t.device) + d2t
        self._features: dict[int, torch.Tensor] = {}  # rid -> target features not yet in the draft cache
        self._graphs: dict[tuple[str, int], GraphRunner] = {}  # (model, tokens per request) -> graphs

    @torch.inference_mode()
    def capture_graphs(self, max_bs: int, eager: bool = False) -> None:
        """Graphs, by batch size up to ``max_bs``, for the plain target step and, for a chain, its
        draft steps (one token per request and the head's own features) and its verify pass (k + 1
        tokens, target logits and features); for a tree, its draft steps (top-k nodes per request,
        the expanded nodes under a mask) and its verify pass (the root and the nodes under the
        tree's mask). Only over backends that read lengths at replay (Triton);
        ``eager``: the CPU stand-in (``cuda_graph.EagerGraph``). Under tensor parallelism every rank
        captures the same graphs in the same order (their collectives line up) and replays the ones
        rank 0 announces (``replay_graph``)."""
        graphable = lambda backend: eager or not backend.fixed_width_under_graphs  # noqa: E731
        device, shape = self.target.device, self.tree_shape
        hidden = dict(extra_widths=(self.draft.shape.hidden_size,), extra_dtype=self.target.dtype)
        graphs = {}  # every graph of a round shares one pool: they never run at once
        pool = None

        def add(key, fn, width, inputs=None, **kw):
            nonlocal pool
            graph = GraphRunner(fn, max_bs, device, width, pool=pool, eager=eager, inputs=inputs, **kw)
            pool = graph.pool
            graphs[key] = graph

        if graphable(self.target.backend):
            target = lambda backend: lambda fb, rows: self._target_pass(fb, backend, rows)  # noqa: E731
            add(("target", 1), target(self.target.backend), 1, name="target (+features) x1")
            if self.tree:
                add(("target_tree", shape.width), target(self.target_tree_backend), shape.width,
                    TreeGraphInputs(max_bs, shape.width, shape.width, device),
                    name=f"tree verify (+features) x{shape.width}")
            else:
                add(("target", self.k + 1), target(self.target.backend), self.k + 1,
                    name=f"target (+features) x{self.k + 1}")
        if graphable(self.draft.backend):
            # the target features the head reads per token (EAGLE3: three layers')
            width = self.target.shape.hidden_size * len(self.draft.aux_layers or [None])
            features = dict(extra_widths=(width,), extra_dtype=self.target.dtype)
            add(("draft_extend", self.extend_width),
                lambda fb, rows, h: self._draft_pass(fb, self.draft.backend, h, True, rows), self.extend_width,
                name=f"draft extend x{self.extend_width}", last_only=True, **features)
            draft = lambda backend: lambda fb, rows, h: self._draft_pass(fb, backend, h, False, rows)  # noqa: E731
            if not self.tree:
                add(("draft", 1), draft(self.draft.backend), 1, name="draft step", **hidden)
            elif shape.steps > 1:
                add(("draft_tree", shape.topk), draft(self.draft.tree_backend), shape.topk,
                    TreeGraphInputs(max_bs, shape.topk, shape.scratch, device), name="draft tree step", **hidden)
        self._graphs.update(graphs)

    @property
    def chain_verify_graphs(self):
        return self._graphs.get(("target", self.k + 1))

    def target_pass(self, fb) -> None:
        self._target(fb, "target")  # the speculator's graphs, as a round's target pass

    @property
    def slots_per_round(self) -> int:
        """Verify slots (last token + proposals), plus the tree's scratch slots for draft K/V."""
        scratch = self.topk * (self.num_steps - 1) if self.tree else 0
        return self.k + 1 + scratch

    # ---- model calls ----------------------------------------------------------------------
    def _backend(self, name: str):
        return {"target": self.target.backend, "target_tree": self.target_tree_backend,
                "draft": self.draft.backend, "draft_tree": self.draft.tree_backend}[name]

    def _mirror(self, call: str, backend: str, fb, rows, hidden=None, from_target: bool = False) -> None:
        """This pass, for the group's other ranks to run on their shards (``replay``)."""
        if not self.mirror.sending:
            return  # nobody to tell: spare the host copies
        width = max(fb.seq_lens_cpu) if fb.seq_lens_cpu else 0
        req_rows = self.target.req_to_token_pool.req_to_token[fb.req_pool_indices, :width].cpu()
        hidden = None if hidden is None else hidden.cpu()
        self.mirror.call((call, backend, _batch_to(fb, "cpu"), req_rows, rows.cpu(), hidden, from_target))

    def replay(self, call: tuple) -> None:
        name, backend, fb, req_rows, rows, hidden, from_target = call
        dev = self.target.device
        fb = _batch_to(fb, dev)
        # The draft adopts the target's req_to_token pool: one mirror of rank 0's rows serves both.
        self.target.req_to_token_pool.req_to_token[fb.req_pool_indices, : req_rows.shape[1]] = req_rows.to(dev)
        if name == "target":
            self._target(fb, backend, rows=rows.to(dev))
        else:
            self._draft(fb, backend, hidden.to(dev), from_target, rows.to(dev))

    @torch.inference_mode()
    def replay_graph(self, key: tuple[str, int], fb, extras) -> None:
        """A follower: replay the graph rank 0 replays, staged with its inputs (``announce_graph``)."""
        self._graphs[key].replay(fb, *extras)

    @torch.inference_mode()
    def _target(self, fb, backend: str, last_only: bool = False, rows=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (every token's, or each request's last) and head features for every token."""
        require(self.target.phase, Phase.BACKENDS_READY, "run a forward pass", self.target.name)
        graph = self._graphs.get((backend, fb.extend_lens[0] if fb.extend_lens else 0))
        if rows is None and not last_only and graph is not None and graph.can_run(fb):
            self.mirror.graph(self.draft.name, (backend, graph.tokens_per_req), fb,
                           self.target.req_to_token_pool.req_to_token)
            return graph.replay(fb)  # every row of the batch, as below
        rows = fb.logit_rows(last_only) if rows is None else rows
        self._mirror("target", backend, fb, rows)
        return self._target_pass(fb, self._backend(backend), rows)

    def _target_pass(self, fb, backend, rows) -> tuple[torch.Tensor, torch.Tensor]:
        capture = HiddenCapture(self.draft.aux_layers)
        logits = self.target.model(fb, backend, rows, capture)
        return logits.float(), capture.features()

    @torch.inference_mode()
    def _draft(self, fb, backend: str, hidden, from_target: bool, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits over the target's vocabulary and next features, at ``rows``."""
        require(self.draft.phase, Phase.BACKENDS_READY, "run a forward pass", self.draft.name)
        graph = self._graphs.get((backend, fb.extend_lens[0] if fb.extend_lens else 0))
        if not from_target and graph is not None and graph.can_run(fb) \
                and rows.numel() == fb.input_ids.numel():  # a draft step (chain or tree): every row
            self.mirror.graph(self.draft.name, (backend, graph.tokens_per_req), fb,
                           self.target.req_to_token_pool.req_to_token, (hidden,))
            return graph.replay(fb, hidden)
        self._mirror("draft", backend, fb, rows, hidden, from_target)
        return self._draft_pass(fb, self._backend(backend), hidden, from_target, rows)

    def _draft_pass(self, fb, backend, hidden, from_target: bool, rows) -> tuple[torch.Tensor, torch.Tensor]:
        normed, feature = self.head(self.embed(fb.input_ids), hidden, from_target, fb, backend)
        normed = normed[rows]
        lm_head = getattr(self.head, "lm_head", None)
        if lm_head is None:
            logits = parallel_logits(normed, self.target.model.head_weight(), self.target.shape.vocab_size,
                                     self.tp).float()
        else:
            logits = parallel_logits(normed, lm_head.weight, self.head.draft_vocab_size, self.tp).float()
            if self._draft_ids is not None:  # scatter draft ids onto their target ids
                full = torch.full((logits.shape[0], self.target.shape.vocab_size), float("-inf"), device=logits.device)
                full[:, self._draft_ids] = logits
                logits = full
        return logits, feature[rows]

    # ---- prefill ----------------------------------------------------------------------------
    def prefill(self, reqs: list[Request], ends: list[int]) -> list[RoundResult | None]:
        """Target features of every prefilled position wait for the head's first extend (D: where the
        prefill began, 0 or the end of the cached prefix whose head K/V the request reuses)."""
        segments = chunk_segments(reqs, ends)
        fb = fresh_batch(self.target.slots, segments, self.target.device)
        every_row = wants_prompt_rows(reqs)
        logits, features = self._target(fb, "target", last_only=not every_row)
        if every_row:
            logits = record_prompt_logprobs(reqs, segments, logits)
        start = 0
        for r, s in zip(reqs, segments):
            chunk = features[start : start + len(s.tokens)]
            start += len(s.tokens)
            pending = self._features.get(r.rid)
            self._features[r.rid] = chunk if pending is None else torch.cat([pending, chunk])
        return self.first_tokens(reqs, ends, logits)

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
        logits, features = self._target(fresh_batch(self.target.slots, segments, self.target.device), "target")
        for i, r in enumerate(reqs):
            r.kv_len += 1
            self._features[r.rid] = torch.cat([self._features[r.rid], features[i : i + 1]])
        return sample_next(reqs, logits, list(range(len(reqs))))

    @torch.inference_mode()
    def _draft_extend(self, reqs):
        """The head over each request's tokens since its cache ends (with their target features):
        its logits and features at the last. A round's own (at most ``extend_width`` per request)
        replay the extend graphs, left-padded; longer ones run as they are."""
        self._catch_up(reqs)
        segments = [Segment(r.req_idx, r.all_ids[r.draft_kv_len + 1 : r.kv_len + 1], r.draft_kv_len) for r in reqs]
        hidden = torch.cat([self._features[r.rid] for r in reqs])
        key = ("draft_extend", self.extend_width)
        graph = self._graphs.get(key)
        if graph is not None and len(reqs) <= graph.max_bs and max(len(s.tokens) for s in segments) <= key[1]:
            fb, real = left_padded_batch(self.draft.req_to_token_pool, segments, key[1], self.draft.device)
            padded = hidden.new_zeros(fb.input_ids.numel(), hidden.shape[-1]).index_copy_(0, real, hidden)
            self.mirror.graph(self.draft.name, key, fb, self.target.req_to_token_pool.req_to_token, (padded,))
            logits, feature = graph.replay(fb, padded)
        else:
            fb = with_cache_locs(make_batch(segments, self.draft.device), self.draft.req_to_token_pool, segments)
            logits, feature = self._draft(fb, "draft", hidden, True, fb.logit_rows(True))
        for r in reqs:
            r.draft_kv_len = r.kv_len
        return logits, feature

    def _catch_up(self, reqs) -> None:
        """When the head's pending positions (a prompt prefilled in chunks, or many rounds without
        drafting) exceed one chunk, extend it over all but each request's last pending position in
        passes of at most ``chunk_tokens`` tokens, as the target's prefill was; the round's own
        extend then reads one position per request."""
        chunk = self.chunk_tokens
        if not chunk or sum(r.kv_len - r.draft_kv_len for r in reqs) <= chunk:
            return
        while True:
            budget, segments, hidden, taken = chunk, [], [], []
            for r in reqs:
                n = min(budget, r.kv_len - 1 - r.draft_kv_len)
                if n <= 0:
                    continue
                d = r.draft_kv_len
                segments.append(Segment(r.req_idx, r.all_ids[d + 1 : d + 1 + n], d))
                hidden.append(self._features[r.rid][:n])
                taken.append((r, n))
                budget -= n
                if not budget:
                    break
            if not segments:
                return
            fb = with_cache_locs(make_batch(segments, self.draft.device), self.draft.req_to_token_pool, segments)
            self._draft(fb, "draft", torch.cat(hidden), True, fb.logit_rows(True))  # only its K/V are kept
            for r, n in taken:
                r.draft_kv_len += n
                self._features[r.rid] = self._features[r.rid][n:]

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
                logits, hidden = self._draft(fb, "draft", hidden, False, fb.logit_rows(False))

        slots = self.target.slots
        chains = torch.cat([rows.last[:, None], tokens], dim=1)
        width = verify_width(self.chain_verify_graphs, ks)
        if width:  # a graph's width for any mix of lengths (requests that do not draft: one valid row), or one length
            fb, padded = rows.verify_batch(slots.req_to_token, reqs, ks, chains, width)
        else:
            padded, segments = None, chain_segments(reqs, ks)
            fb = with_cache_locs(make_batch(segments, device), slots.rows, segments)
            fb.input_ids = ragged_ids(chains, ks)
        target_logits, features = self._target(fb, "target")
        accepted, nexts, drafted, logprobs = accept_chains(reqs, tokens, probs, target_logits, ks, padded)
        results, start, rejected = [], 0, []
        for r, k, n, nxt, chain, lp in zip(reqs, ks, accepted, nexts, drafted, logprobs):
            verified = slice(start, start + k + 1)
            start += k + 1 if padded is None else padded.width
            last = r.kv_len
            r.kv_len = last + n + 1
            rejected.append((r.req_idx, r.kv_len, last + self.k + 1))
            self._features[r.rid] = features[verified][: n + 1].clone()  # graph outputs are overwritten
            results.append(RoundResult(chain[:n] + [nxt], proposed=k, accepted=n, logprobs=lp))
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
            step_logits, step_hidden = self._draft(fb, "draft_tree", front_hidden, False, fb.logit_rows(False))
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
        logits, features = self._target(fb, "target_tree")
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
            r.kv_len += len(keep)
            self._features[r.rid] = kept_features[i]
            results.append(RoundResult(emitted[i], proposed=ks[i], accepted=count[i], logprobs=logprobs[i]))
        kv_slots.give_back(torch.tensor(rejected, dtype=torch.int64))
        return results


def _batch_to(fb, device):
    """A copy of a (tree) forward batch with its tensors, and lists of tensors, on ``device``."""
    def move(v):
        if isinstance(v, torch.Tensor):
            return v.to(device)
        if isinstance(v, list) and v and isinstance(v[0], torch.Tensor):
            return [t.to(device) for t in v]
        return v

    return dataclasses.replace(fb, **{f.name: move(getattr(fb, f.name)) for f in dataclasses.fields(fb)})
