"""CUDA graphs for uniform batches: static buffers per batch size, replayed with padding.

A runner serves batches whose requests each bring the same number of new tokens: 1 for decode
and draft steps, K + 1 for chain verification (every verify batch padded to K + 1 rows per request,
whatever each request drafts, so the adaptive policy's mixed lengths replay the same graph:
``chain_graph_width``, ``batch.padded_chain_batch``). Buffers are sized by batch size only. With the
Triton backend the kernels read ``seq_lens`` and ``req_to_token`` at replay and bound their loops
by each request's length, so one graph per batch size serves every context length and the graph
pool holds activations of ``bs x tokens`` rows, never ``bs x contextLength``. (The torch-native
backend, forced on CUDA, still gathers a fixed ``[bs, contextLength]`` block: it is the reference,
not the fast path.)

Extend graphs (``last_only``) take passes of up to that many new tokens per request whose
logits are wanted at each request's last token only: a STANDALONE draft's first step over the
tokens it has not cached, an EAGLE or MTP head's extend over a round's accepted tokens. Their
batches are left-padded (``batch.left_padded_batch``), so that each request's last row sits at a
fixed place, ``(i + 1) x width - 1``.

``GraphRunner`` graphs any function of a static batch (and of static per-token inputs, such as an
EAGLE head's features) returning tensors; ``CudaGraphRunner`` is it over a model's forward.
``GraphInputs`` (the buffers and how a batch is staged into them) holds no CUDA call. With
``eager=True`` a runner keeps the same buffers and the same staging but replays by calling the
function again into its captured outputs (``EagerGraph``), so CPU tests check padding, staging
and output slicing against an eager pass.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from .forward_batch import ForwardBatch

log = logging.getLogger(__name__)


_graph_passes = 0  # > 0 while a runner's function runs: its warm-up, its capture, an eager replay


@contextlib.contextmanager
def graph_pass():
    global _graph_passes
    _graph_passes += 1
    try:
        yield
    finally:
        _graph_passes -= 1


def in_graph_pass() -> bool:
    """A graph runner's function is running (and the pre-capture warm-up compiles what the capture
    records): code with a host-dependent eager path (MoE's routing) takes its static one."""
    return _graph_passes > 0


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, max_bs + 1, 8))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


def padded_size(sizes: list[int], n: int) -> int:
    """The smallest captured batch size that holds ``n`` requests."""
    return next(s for s in sizes if s >= n)


def chain_graph_width(graphs, batch_size: int, longest: int) -> int:
    """The rows per request a verify pass of chains is padded to for ``graphs`` (a runner of one
    width, or None), or 0 to run it as it is: without graphs, above their largest batch, chains
    longer than they take, or nobody drafting (a plain decode step, which the decode graphs take).
    Padding a request (``batch.padded_chain_batch``) costs rows but never a second graph: any mix
    of draft lengths, 0 included, replays the one graph of width K + 1."""
    if graphs is None or not longest or batch_size > graphs.max_bs or longest + 1 > graphs.tokens_per_req:
        return 0
    return graphs.tokens_per_req


class GraphInputs:
    """Static input buffers for up to ``max_bs`` requests of ``tokens_per_req`` new tokens each."""

    def __init__(self, max_bs: int, tokens_per_req: int, device):
        self.max_bs, self.tokens_per_req = max_bs, tokens_per_req
        n_tok = max_bs * tokens_per_req
        z = lambda n: torch.zeros(n, dtype=torch.int64, device=device)  # noqa: E731
        self.input_ids, self.out_cache_loc, self.req_pool_indices = z(n_tok), z(n_tok), z(max_bs)
        self.seq_lens = torch.full((max_bs,), tokens_per_req, dtype=torch.int64, device=device)
        # Logit rows: every new token. A graph reads every tensor at the address it had at capture,
        # so this must outlive the capture (a per-size temporary would be freed and reused).
        self.rows = torch.arange(n_tok, device=device)
        self.last_rows = torch.arange(1, max_bs + 1, device=device) * tokens_per_req - 1  # extend graphs' rows
        # A padding request: positions 0..n-1 of request slot 0, written to KV slot 0 (no request owns
        # it). It reads request 0's first positions and its output is discarded.
        self._pad_positions = torch.arange(tokens_per_req, device=device).repeat(max_bs)
        self.positions = self._pad_positions.clone()
        self._batches: dict[int, ForwardBatch] = {}

    def batch(self, bs: int) -> ForwardBatch:
        """The static batch of ``bs`` requests that a graph is captured with and replays (one object
        per size: staging also refreshes its host-side lengths, which only eager replays read)."""
        if bs not in self._batches:
            self._batches[bs] = self._make_batch(bs)
        return self._batches[bs]

    def _make_batch(self, bs: int) -> ForwardBatch:
        n = self.tokens_per_req
        return ForwardBatch(
            input_ids=self.input_ids[: bs * n], positions=self.positions[: bs * n],
            out_cache_loc=self.out_cache_loc[: bs * n], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], extend_lens=[n] * bs, seq_lens_cpu=[n] * bs,
        )

    def accepts(self, fb: ForwardBatch) -> bool:
        return (not fb.is_tree and fb.batch_size <= self.max_bs
                and all(e == self.tokens_per_req for e in fb.extend_lens))

    def stage(self, fb: ForwardBatch, bs: int) -> None:
        """Copy ``fb`` into the first rows and pad up to ``bs`` requests (device copies only)."""
        real, n = fb.batch_size, self.tokens_per_req
        t_real, t_bs = real * n, bs * n
        self.input_ids[t_real:t_bs].zero_()
        self.out_cache_loc[t_real:t_bs].zero_()
        self.positions[t_real:t_bs].copy_(self._pad_positions[t_real:t_bs])
        self.req_pool_indices[real:bs].zero_()
        self.seq_lens[real:bs].fill_(n)
        self.input_ids[:t_real].copy_(fb.input_ids)
        self.positions[:t_real].copy_(fb.positions)
        self.out_cache_loc[:t_real].copy_(fb.out_cache_loc)
        self.req_pool_indices[:real].copy_(fb.req_pool_indices)
        self.seq_lens[:real].copy_(fb.seq_lens)
        if bs in self._batches:
            self._batches[bs].seq_lens_cpu[:] = list(fb.seq_lens_cpu) + [n] * (bs - real)


class EagerGraph:
    """Stands in for a captured CUDA graph where there is none (CPU tests): replay calls the
    function again on the same static buffers and writes into the outputs taken at capture."""

    def __init__(self, fn):
        self.fn = fn
        self.outputs = fn()

    def replay(self) -> None:
        for out, new in zip(self.outputs, self.fn()):
            out.copy_(new)


def _as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


class GraphRunner:
    """Graphs ``fn(fb, rows, *extras) -> tensor(s)`` for every captured batch size.

    ``extra_widths``: static per-token inputs besides the batch (``[tokens, width]`` each, staged
    like the token ids, zero for padding rows). Outputs have one row per token, in order, or with
    ``last_only`` one per request, at its last token.
    """

    def __init__(self, fn, max_bs: int, device, tokens_per_req: int = 1, extra_widths: tuple[int, ...] = (),
                 extra_dtype=None, pool=None, eager: bool = False, name: str = "model",
                 inputs: GraphInputs | None = None, last_only: bool = False):
        self.fn, self.eager, self.last_only = fn, eager, last_only
        self.sizes = capture_sizes(max_bs)
        self.max_bs = max_bs
        self.inputs = inputs or GraphInputs(max_bs, tokens_per_req, device)  # a subclass stages more
        n_tok = max_bs * tokens_per_req
        self.extras = [torch.zeros(n_tok, w, dtype=extra_dtype, device=device) for w in extra_widths]
        self.graphs: dict = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        # Every size writes its outputs into the largest graph's (a view of their first rows), so
        # the pool holds one set of outputs, not one per captured size.
        self._static_out: tuple[torch.Tensor, ...] | None = None
        # Runners may share one memory pool (their graphs never run at once); each replay's
        # outputs are consumed before the next replay.
        self.pool = None if eager else (torch.cuda.graph_pool_handle() if pool is None else pool)
        for bs in reversed(self.sizes):  # largest first so smaller graphs reuse its memory
            fb = self.inputs.batch(bs)
            rows = self.inputs.last_rows[:bs] if last_only else self.inputs.rows[: bs * tokens_per_req]
            extras = [e[: bs * tokens_per_req] for e in self.extras]

            def call(fb=fb, rows=rows, extras=extras):
                with graph_pass():
                    out = _as_tuple(fn(fb, rows, *extras))
                if self._static_out is None:
                    return out
                return tuple(static[: o.shape[0]].copy_(o) for static, o in zip(self._static_out, out))

            if eager:
                graph = EagerGraph(call)
                self.outputs[bs] = graph.outputs
            else:
                stream = capture_warmup_stream(device)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):  # compiles the Triton kernels for this shape before capture
                        call()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.outputs[bs] = call()
            self.graphs[bs] = graph
            if self._static_out is None:
                self._static_out = self.outputs[bs]
        log.info("%s: %s graphs for batch sizes %s (%d token(s) per request%s)", name,
                 "eager stand-in" if eager else "captured CUDA", self.sizes, tokens_per_req,
                 ", the last's logits" if last_only else "")

    @property
    def tokens_per_req(self) -> int:
        return self.inputs.tokens_per_req

    def can_run(self, fb: ForwardBatch) -> bool:
        return self.inputs.accepts(fb)

    def replay(self, fb: ForwardBatch, *extras: torch.Tensor) -> tuple[torch.Tensor, ...]:
        bs = padded_size(self.sizes, fb.batch_size)
        self.inputs.stage(fb, bs)
        n, t_bs = fb.batch_size * self.tokens_per_req, bs * self.tokens_per_req
        for static, x in zip(self.extras, extras):
            static[:n].copy_(x)
            static[n:t_bs].zero_()
        self.graphs[bs].replay()
        rows = fb.batch_size if self.last_only else n
        return tuple(out[:rows] for out in self.outputs[bs])


_warmup_streams: dict = {}


def capture_warmup_stream(device) -> "torch.cuda.Stream":
    """The one side stream that every graph's pre-capture warm-up runs on, per device: cuBLAS keeps
    a workspace per stream, so a stream per captured size would hold workspaces the plan never priced."""
    index = torch.device(device).index
    key = torch.cuda.current_device() if index is None else index
    if key not in _warmup_streams:
        _warmup_streams[key] = torch.cuda.Stream(device=key)
    return _warmup_streams[key]


class CudaGraphRunner(GraphRunner):
    """A model's forward ``model(fb, backend, rows)`` graphed; ``replay`` returns its logits."""

    def __init__(self, model, backend, max_bs: int, context_len: int, device, tokens_per_req: int = 1, pool=None,
                 eager: bool = False, last_only: bool = False):
        if not eager:  # eager replays read each batch's own lengths
            fix_gather_width(backend, context_len)
        super().__init__(lambda fb, rows: model(fb, backend, rows), max_bs, device, tokens_per_req, pool=pool,
                         eager=eager, last_only=last_only, name="extend" if last_only else "model")

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        return super().replay(fb)[0]


def fix_gather_width(backend, context_len: int) -> None:
    """Torch-native decode gathers a fixed ``[bs, contextLength]`` block under a graph (static shapes)."""
    if backend.fixed_width_under_graphs:
        backend.decode_ctx = context_len
        log.warning("CUDA graphs with the torch-native backend gather [batch, %d] K/V per layer; "
                    "their memory grows with the context length", context_len)
