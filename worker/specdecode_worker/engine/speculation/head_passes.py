"""The passes of a head's round: the target's (logits and the features the head reads) and the
head's own steps, each through a captured graph where one takes the batch, else eagerly.

Under tensor parallelism the head shards with the target (``models.eagle``). Rank 0 runs the
rounds; each target pass and head step it runs is announced to the other ranks with its batch,
the req_to_token rows it reads, and (head steps) the features, so every rank runs the same pass
on its shards and the collectives line up: a graph replay as a replay of the same graph with the
same staged inputs (``Mirror.graph``, ``replay_graph``), an eager pass as that pass
(``Mirror.call``, ``HeadPasses.replay``).
"""

from __future__ import annotations

import dataclasses

import torch

from ..batch import left_padded_batch, make_batch, with_cache_locs
from ..cuda_graph import GraphRunner
from ..kernels.tree_attention import make_tree_attn_backend
from ..model_runner import ModelRunner
from ..parallel.parallel_layers import parallel_logits
from ..phases import Phase, require
from .head_runner import HiddenCapture
from .tree import TreeShape
from .tree_graph import TreeGraphInputs


class HeadPasses:
    """Runs a head speculator's passes (``run_target``, ``run_draft``, ``extend``) over the graphs
    ``capture`` took, and replays on a follower rank the passes rank 0 announced."""

    def __init__(self, target_runner: ModelRunner, draft_runner: ModelRunner):
        self.target = target_runner
        self.draft = draft_runner  # an EAGLE head's runner or the MTP layer's
        self.head = draft_runner.model
        self.target_tree_backend = make_tree_attn_backend(target_runner.req_to_token_pool,
                                                          target_runner.token_to_kv_pool,
                                                          target_runner.model.sliding_window)
        self.embed = target_runner.model.model.embed_tokens
        self.tp = draft_runner.tp  # the target's group: heads and the MTP layer shard with it
        self.mirror = target_runner.mirror  # the group's other ranks run these passes too
        d2t = getattr(self.head, "d2t", None)
        self._draft_ids = None if d2t is None else torch.arange(d2t.numel(), device=d2t.device) + d2t
        self.graphs: dict[tuple[str, int], GraphRunner] = {}  # (model, tokens per request) -> graphs

    @torch.inference_mode()
    def capture(self, max_bs: int, eager: bool, k: int, extend_width: int, tree: TreeShape | None) -> None:
        """Graphs, by batch size up to ``max_bs``, for the plain target step and, for a chain (``tree``
        None), its draft steps (one token per request and the head's own features) and its verify
        pass (k + 1 tokens, target logits and features); for a tree, its draft steps (top-k nodes per
        request, the expanded nodes under a mask) and its verify pass (the root and the nodes under
        the tree's mask); and the head's extend over a round's ``extend_width`` tokens. Only over
        backends that read lengths at replay (Triton); ``eager``: the CPU stand-in
        (``cuda_graph.EagerGraph``). Under tensor parallelism every rank captures the same graphs in
        the same order (their collectives line up) and replays the ones rank 0 announces
        (``replay_graph``)."""
        graphable = lambda backend: eager or not backend.fixed_width_under_graphs  # noqa: E731
        device, shape = self.target.device, tree
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
            if tree is not None:
                add(("target_tree", shape.width), target(self.target_tree_backend), shape.width,
                    TreeGraphInputs(max_bs, shape.width, shape.width, device),
                    name=f"tree verify (+features) x{shape.width}")
            else:
                add(("target", k + 1), target(self.target.backend), k + 1, name=f"target (+features) x{k + 1}")
        if graphable(self.draft.backend):
            # the target features the head reads per token (EAGLE3: three layers')
            width = self.target.shape.hidden_size * len(self.draft.aux_layers or [None])
            features = dict(extra_widths=(width,), extra_dtype=self.target.dtype)
            add(("draft_extend", extend_width),
                lambda fb, rows, h: self._draft_pass(fb, self.draft.backend, h, True, rows), extend_width,
                name=f"draft extend x{extend_width}", last_only=True, **features)
            draft = lambda backend: lambda fb, rows, h: self._draft_pass(fb, backend, h, False, rows)  # noqa: E731
            if tree is None:
                add(("draft", 1), draft(self.draft.backend), 1, name="draft step", **hidden)
            elif shape.steps > 1:
                add(("draft_tree", shape.topk), draft(self.draft.tree_backend), shape.topk,
                    TreeGraphInputs(max_bs, shape.topk, shape.scratch, device), name="draft tree step", **hidden)
        self.graphs.update(graphs)

    @torch.inference_mode()
    def run_target(self, fb, backend: str, last_only: bool = False, rows=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (every token's, or each request's last) and head features for every token."""
        require(self.target.phase, Phase.BACKENDS_READY, "run a forward pass", self.target.name)
        graph = self.graphs.get((backend, fb.extend_lens[0] if fb.extend_lens else 0))
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
    def run_draft(self, fb, backend: str, hidden, from_target: bool, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits over the target's vocabulary and next features, at ``rows``."""
        require(self.draft.phase, Phase.BACKENDS_READY, "run a forward pass", self.draft.name)
        graph = self.graphs.get((backend, fb.extend_lens[0] if fb.extend_lens else 0))
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

    @torch.inference_mode()
    def extend(self, segments, hidden, width: int):
        """The head over each segment's tokens with their target features ``hidden``: its logits and
        features at each segment's last token. Segments of at most ``width`` tokens replay the extend
        graphs, left-padded; longer ones run as they are."""
        key = ("draft_extend", width)
        graph = self.graphs.get(key)
        if graph is not None and len(segments) <= graph.max_bs and max(len(s.tokens) for s in segments) <= key[1]:
            fb, real = left_padded_batch(self.draft.req_to_token_pool, segments, key[1], self.draft.device)
            padded = hidden.new_zeros(fb.input_ids.numel(), hidden.shape[-1]).index_copy_(0, real, hidden)
            self.mirror.graph(self.draft.name, key, fb, self.target.req_to_token_pool.req_to_token, (padded,))
            logits, feature = graph.replay(fb, padded)
        else:
            fb = with_cache_locs(make_batch(segments, self.draft.device), self.draft.req_to_token_pool, segments)
            logits, feature = self.run_draft(fb, "draft", hidden, True, fb.logit_rows(True))
        return logits, feature

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
        """A follower: run the eager pass rank 0 announced (``_mirror``) on this rank's shards."""
        name, backend, fb, req_rows, rows, hidden, from_target = call
        dev = self.target.device
        fb = _batch_to(fb, dev)
        # The draft adopts the target's req_to_token pool: one mirror of rank 0's rows serves both.
        self.target.req_to_token_pool.req_to_token[fb.req_pool_indices, : req_rows.shape[1]] = req_rows.to(dev)
        if name == "target":
            self.run_target(fb, backend, rows=rows.to(dev))
        else:
            self.run_draft(fb, backend, hidden.to(dev), from_target, rows.to(dev))

    @torch.inference_mode()
    def replay_graph(self, key: tuple[str, int], fb, extras) -> None:
        """A follower: replay the graph rank 0 replays, staged with its inputs (``Mirror.graph``)."""
        self.graphs[key].replay(fb, *extras)


def _batch_to(fb, device):
    """A copy of a (tree) forward batch with its tensors, and lists of tensors, on ``device``."""
    def move(v):
        if isinstance(v, torch.Tensor):
            return v.to(device)
        if isinstance(v, list) and v and isinstance(v[0], torch.Tensor):
            return [t.to(device) for t in v]
        return v

    return dataclasses.replace(fb, **{f.name: move(getattr(fb, f.name)) for f in dataclasses.fields(fb)})
