"""Phase 3's warm-up: the dynamic memory peak measured against the plan's ``R_dynamic``.

After the attention backends, CUDA graphs and the speculator are ready, the engine serves two
throw-away workloads through the speculator, the code path serving runs, at the plan's maxima:

1. the longest prompt (contextLength - 1 tokens, as many as the pool allows) prefilled in passes
   of ``chunkedPrefillSize`` tokens, then one round for it, so a draft catches up over the whole
   prompt in chunk-sized passes: an EAGLE head or MTP NextN layer reading the target features held
   since the prefill, a STANDALONE draft model its own prompt pass;
2. one speculative round at the largest batch serving runs (``maxRunningRequests``, which the
   graph batch ``cudaGraphMaxBs`` never exceeds) with every request drafting K tokens: the draft
   steps (chain, or tree steps under the tree mask), the verify pass (K + 1 rows, or the tree's
   nodes, returning features for EAGLE and MTP), sampling with temperature, top-k and top-p (the
   widest sampling buffers) and acceptance. NGRAM prompts repeat, so lookups find K tokens.

Every slot, request row and free-list order is restored afterwards, on success or failure; the
requests draw from their own seeded generators (the global RNG is never read) and never meet the
engine's counters or the speculation policy, which is built after this. The allocator's peak over
both workloads, less what weights and pools hold, is the measured dynamic peak (activations,
logits, sampling buffers and the CUDA graph pools, which stay allocated). A measured value above
the plan is logged as a warning with both numbers; running out of memory is a start-up error
naming the workload and what to lower.

Under tensor parallelism rank 0 runs the workloads (every pass announced as in serving) while the
other ranks replay them (``ModelWorker.warm_up``); rank 0's peak is the one reported.

Only CUDA's caching allocator keeps a peak. On CPU there is nothing to read: the warm-up is skipped
(it would only cost start-up time) and the measured value is None, reported as not measured,
never estimated.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch

from .sampler import to_host
from .request import Request, SamplingParams, make_generator
from .speculation.rounds import prefilled_to

log = logging.getLogger(__name__)

# The warm-up's requests sample with every filter on: temperature, then a top-k and a top-p cut
# (each a sort over the vocabulary), the most memory a round's sampling and acceptance can take.
WARM_UP_SAMPLING = SamplingParams(max_tokens=1, temperature=1.0, top_k=2, top_p=0.9, seed=0)
# Counters a speculator keeps across rounds; the warm-up puts them back as they were.
SPECULATOR_COUNTERS = ("draft_tokens",)  # what a round counts on the speculator (Speculator.draft_tokens)


class WarmUpOutOfMemory(RuntimeError):
    """The largest planned pass does not fit beside the weights and pools."""


def out_of_memory(exc: BaseException) -> bool:
    """torch's allocator refusing, or a kernel launch the driver could not give memory to (Triton
    raises a RuntimeError for a launch whose code or local memory does not fit)."""
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc)


def device_memory_now(device) -> str:
    """``, with X of Y GiB free on the device``, as the driver counts it, where there is one."""
    if torch.device(device).type != "cuda":
        return ""
    free, total = torch.cuda.mem_get_info(device)
    return f", with {free / 2**30:.2f} of {total / 2**30:.2f} GiB free on the device"


@dataclass(frozen=True)
class DynamicPeak:
    """The warm-up's dynamic memory, three ways, each beyond weights and pools: what tensors held
    at most (allocated), what the caching allocator held at most (reserved: its slack and the
    CUDA graph pools included), and what the driver saw in use at the end, beyond the runtime
    reserve too (kernel images, cuBLAS workspaces and anything else outside the allocator)."""

    planned: int | None  # R_dynamic of the plan served (None: no plan gave one)
    measured: int | None  # allocated peak beyond weights and pools over the warm-up (None: not measurable)
    chunk_tokens: int = 0  # the largest prefill pass's tokens
    batch: int = 0  # the round's requests ...
    width: int = 0  # ... and verify rows per request
    prompt_tokens: int = 0  # the long prompt prefilled in chunks (and caught up by the draft)
    passes: tuple[str, ...] = ()  # what the warm-up ran, in order
    note: str = ""
    reserved: int | None = None  # the allocator's reserved peak beyond weights and pools
    driver: int | None = None  # device memory in use at the end (mem_get_info) beyond weights, pools and runtime

    def views(self) -> dict[str, int]:
        """Each measured view by name."""
        return {name: v for name, v in (("allocated", self.measured), ("reserved", self.reserved),
                                         ("driver", self.driver)) if v is not None}

    def over(self) -> list[str]:
        """The views above the plan."""
        return [] if self.planned is None else [name for name, v in self.views().items() if v > self.planned]

    @property
    def over_plan(self) -> bool:
        return bool(self.over())

    def as_dict(self) -> dict:
        out = asdict(self)
        out["passes"] = list(self.passes)
        return out


class CudaPeak:
    """The CUDA caching allocator's peaks of allocated and reserved bytes since ``reset``, and the
    driver's free bytes now."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))

    def reserved_peak(self) -> int:
        return int(torch.cuda.max_memory_reserved(self.device))

    def free(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.mem_get_info(self.device)[0])


def peak_reader(device: torch.device) -> CudaPeak | None:
    """What reads the allocator's peak on ``device``; None where none is kept (CPU)."""
    return CudaPeak(device) if device.type == "cuda" else None


def measurable(device: torch.device) -> bool:
    """Whether the warm-up runs on ``device``: only where an allocator peak can be read."""
    return peak_reader(device) is not None


def static_bytes(runners) -> int:
    """Bytes the plan counts as static: weights, KV pools and the req_to_token map."""
    total = runners[0].req_to_token_pool.nbytes()
    for runner in runners:
        total += runner.weight_bytes + runner.token_to_kv_pool.nbytes()
    return total


@dataclass(frozen=True)
class Workloads:
    """The warm-up's two workloads for one speculator, clamped to what the pools hold."""

    prompt: int  # the long prompt's tokens
    chunk: int  # tokens per prefill pass (and per draft catch-up pass)
    batch: int  # requests in the full round
    batch_prompt: int  # each of their prompts' tokens
    width: int  # verify rows per request

    @classmethod
    def fit(cls, spec, chunk_tokens: int, batch: int) -> "Workloads":
        slots = spec.target.slots
        k, per_round = spec.k, spec.slots_per_round
        context = slots.req_to_token.shape[1] - k - 1  # rows hold contextLength + k + 1 positions
        prompt = max(1, min(context - 1, slots.free_slots() - per_round))
        chunk = max(1, min(chunk_tokens or prompt, prompt))
        # NGRAM finds K tokens after the latest earlier match of the last n tokens: two periods of
        # k + 1 distinct tokens after n of them repeat far enough back.
        batch_prompt = max(1, min(prompt, spec.ngram_max + 2 * (k + 1)))
        batch = max(1, min(batch, slots.free_rows(), slots.free_slots() // (batch_prompt + per_round)))
        tree = spec.tree_shape if spec.tree else None
        width = tree.width if tree is not None else k + 1
        return cls(prompt, chunk, batch, batch_prompt, width)

    def passes(self, spec) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """What serving runs that each workload exercises, in words (the DynamicPeak note)."""
        draft = spec.method.draft_name if spec.draft is not None else None
        long = [f"target prefill of a {self.prompt}-token prompt in passes of up to {self.chunk} tokens"]
        if draft:
            reads = " with the target features it reads" if spec.method.reads_target_features else ""
            long.append(f"{draft} catch-up over that prompt in passes of up to {self.chunk} tokens{reads}")
        full = []
        if draft and spec.tree:
            shape = spec.tree_shape
            full.append(f"{draft} tree steps: {self.batch} requests x {shape.steps} steps of top-{shape.topk}")
        elif draft:
            full.append(f"{draft} chain steps: {self.batch} requests x {spec.k}")
        elif spec.method.drafts:  # a lookup, no pass
            full.append(f"n-gram lookups: {self.batch} requests x {spec.k} tokens")
        kind = "tree verify" if spec.tree else "verify" if spec.k else "decode"
        features = " (+ features)" if spec.method.reads_target_features else ""
        full.append(f"{kind}{features}: {self.batch} requests x {self.width} tokens, then sampling "
                    f"(temperature, top-k, top-p) and acceptance")
        return tuple(long), tuple(full)


def warm_up(spec, runners, planned: int | None, chunk_tokens: int, batch: int,
            device_bytes: int | None = None, runtime_bytes: int = 0) -> DynamicPeak:
    """Run the two workloads through ``spec`` (its target owns the shared pools) and read the peak.
    ``runners``: every model runner, whose weights and pools are static; ``device_bytes``: the
    device memory free before start-up (the plan's G; None: no driver view), of which
    ``runtime_bytes`` went to the runtime (phase 2's measurement)."""
    target = spec.target
    reader = peak_reader(target.device)
    if reader is None:
        return DynamicPeak(planned, None, note=f"not measurable on {target.device.type}: no allocator peak")
    work = Workloads.fit(spec, chunk_tokens, batch)
    long, full = work.passes(spec)
    static = static_bytes(runners)
    reader.reset()
    for run, stage, lower in ((_long_prompt, long, "a smaller chunkedPrefillSize (or contextLength)"),
                              (_full_round, full, "a smaller cudaGraphMaxBs and maxRunningRequests, or fewer "
                                                  "draft tokens")):
        try:
            with LeavesNoTrace(spec) as trace:
                run(spec, work, trace)
        except RuntimeError as exc:  # torch.OutOfMemoryError is one
            if not out_of_memory(exc):  # serving would run out at its first long prompt or full batch
                raise
            raise WarmUpOutOfMemory(
                f"phase 3's warm-up ran out of device memory in: {'; '.join(stage)}; with {planned} bytes "
                f"planned for activations and graphs (reserve.dynamicBytes){device_memory_now(target.device)}: "
                f"give {lower}, or a lower --mem-fraction-static ({str(exc).splitlines()[0]})") from None
    passes = long + full
    driver = None if device_bytes is None else max(0, device_bytes - reader.free() - static - runtime_bytes)
    peak = DynamicPeak(planned, max(0, reader.peak() - static), work.chunk, work.batch, work.width, work.prompt,
                       passes, note="warm-up: " + "; ".join(passes),
                       reserved=max(0, reader.reserved_peak() - static), driver=driver)
    seen = ", ".join(f"{name} {v}" for name, v in peak.views().items())
    if peak.over_plan:
        log.warning("dynamic memory measured in the warm-up (%s bytes) is above the plan's %d bytes "
                    "(reserve.dynamicBytes) as %s: lower --mem-fraction-static or cudaGraphMaxBs/chunkedPrefillSize",
                    seen, planned, " and ".join(peak.over()))
    else:
        log.info("dynamic memory: planned %s bytes, measured %s bytes (%s)", planned, seen, peak.note)
    return peak


class LeavesNoTrace:
    """Takes note of the pools' free lists and the speculator's counters; on leaving, whatever
    happened, forgets the requests it made and puts back every slot, request row (its contents
    too) and free-list order, and the counters, as they were."""

    def __init__(self, spec):
        self.spec = spec
        self.slots = spec.target.slots

    def __enter__(self) -> "LeavesNoTrace":
        self.free_lists = self.slots.snapshot()
        self.counters = {name: getattr(self.spec, name) for name in SPECULATOR_COUNTERS}
        self.transfers = to_host.count
        self.taken: list[tuple[Request, torch.Tensor]] = []
        return self

    def request(self, prompt: list[int], rid: int, params: SamplingParams = WARM_UP_SAMPLING) -> Request:
        """A warm-up request in a request row of its own; negative ids never meet a served one's."""
        r = Request(prompt, params, rid=rid, generator=make_generator(params.seed))
        r.req_idx = self.slots.open_row()
        r.prefill_ids = list(prompt)
        self.taken.append((r, self.slots.req_to_token[r.req_idx].clone()))
        return r

    def __exit__(self, *exc) -> None:
        for r, row in self.taken:
            self.spec.release(r)
            self.slots.req_to_token[r.req_idx] = row
        self.slots.restore(self.free_lists)
        for name, value in self.counters.items():
            setattr(self.spec, name, value)
        to_host.count = self.transfers


def prefill_requests(spec, reqs: list[Request], chunk: int, next_token) -> None:
    """Prefill ``reqs`` in passes of at most ``chunk`` tokens, oldest first, as serving does; each
    then holds ``next_token(r)`` as its last committed token (not yet in any cache)."""
    while pending := [r for r in reqs if r.kv_len < len(r.prefill_ids)]:
        budget, batch, ends = chunk, [], []
        for r in pending:
            n = min(budget, len(r.prefill_ids) - r.kv_len)
            if n <= 0:
                break
            batch.append(r)
            ends.append(r.kv_len + n)
            budget -= n
        spec.prefill(batch, ends)
        prefilled_to(batch, ends)
    for r in reqs:
        r.prefill_ids = None
        r.output_ids = [next_token(r)]


def _long_prompt(spec, work: Workloads, trace: LeavesNoTrace) -> None:
    """The longest prompt in chunks, then one round: the draft catches up over all of it."""
    vocab = spec.target.shape.vocab_size
    r = trace.request([i % vocab for i in range(work.prompt)], rid=-1)
    prefill_requests(spec, [r], work.chunk, lambda r: 0)
    if spec.k:
        spec.decode_round([r])


def _full_round(spec, work: Workloads, trace: LeavesNoTrace) -> None:
    """The largest batch, each request drafting K tokens (a repeating prompt, so NGRAM finds them)."""
    period = spec.k + 1
    pattern = [1 + i % period for i in range(work.batch_prompt + 1)]
    reqs = [trace.request(pattern[:-1], rid=-2 - i) for i in range(work.batch)]
    prefill_requests(spec, reqs, work.chunk, lambda r: pattern[-1])
    spec.decode_round(reqs)
