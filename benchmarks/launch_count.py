"""Kernel launches and host syncs, counted on CPU: per decode layer, and per speculative round.

On a GPU a batch-1 decode step is mostly launches: an H200 ran 1,519 kernels per step of the 8B
target, 6.5 ms of work and ~1.5 ms of gaps for 3.6 ms of weight reads (docs/gpu-data-path.md).
Two tables, from Llama-3.1-8B's geometry cut to 2 layers (bf16, batch 1, Triton attention):

- per layer: one decode forward, with the layer's elementwise work as torch ops
  (``SPECDECODE_LAYER_KERNELS=torch``) and as this project's fused kernels (the CUDA default);
- per round, fused kernels, k = 3: a plain step, an EAGLE3 chain round, an EAGLE3 tree round
  (top-3, 3 steps, 6 nodes), a STANDALONE round with Llama-3.2-1B's geometry cut to 2 layers,
  and an MTP round (DeepSeek-V3's structure at a small width: MLA, 64 routed experts of which 8
  are chosen, grouped routing, and its NextN layer). Each round's passes (target and draft
  forwards), the launches outside them (inputs, sampling, acceptance), host reads and host copies.

A launch is an operator that launches a kernel on a GPU (views and empty allocations excluded)
or a Triton kernel (counted under TRITON_INTERPRET=1, the operators the interpreter runs inside
it excluded). A host read is a read of a tensor's values on the host (``to_host``, ``.tolist()``,
``.item()``) or an operator whose output size depends on values (``nonzero``, ``unique``, a
boolean index): on a GPU each one waits for the device. A host copy is one through
``forward_batch.host_to_device``. The counts are of the rounds run eagerly; a CUDA graph runs the
same kernels from one launch on the host. A count is not a time: a cuBLAS matrix product may
launch a split-K reduction beside it, and the GPU run shows what each costs.

    TRITON_INTERPRET=1 .venv/bin/python benchmarks/launch_count.py
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
os.environ.setdefault("SPECDECODE_ATTENTION_BACKEND", "triton")
os.environ.setdefault("SPECDECODE_CPU_PACKING", "0")  # products as F.linear, as a GPU runs them (not oneDNN's)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "worker"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from specdecode_worker.engine.kernels import layer_kernels  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402

LLAMA_8B_2_LAYERS = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                         num_key_value_heads=8, max_position_embeddings=2048, rope_theta=500000.0)
LLAMA_1B_2_LAYERS = {**LLAMA_8B_2_LAYERS, "hidden_size": 2048, "intermediate_size": 8192, "head_dim": 64}
# DeepSeek-V3's routing (8 of 64 experts here, 256 there; 8 groups, 4 kept) and its dense first
# layer, at a small width: a layer's launches depend on its structure, not its sizes.
DEEPSEEK_SMALL = dict(num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=64, num_experts_per_tok=8,
                      n_group=8, topk_group=4)
# Operators that make no kernel: views, metadata and allocations.
NO_KERNEL = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "as_strided", "t", "transpose",
             "permute", "unsqueeze", "squeeze", "detach", "alias", "split", "split_with_sizes", "unbind",
             "narrow", "diagonal", "_reshape_alias", "lift_fresh", "empty", "empty_like", "empty_strided",
             "new_empty", "new_empty_strided", "_local_scalar_dense", "is_nonzero", "sym_size", "sym_stride",
             "sym_numel", "sym_storage_offset", "dim", "size", "stride"}


# Operators whose output size depends on the values: on a GPU the host waits for the device.
VALUE_SIZED = {"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
               "unique_consecutive", "unique_dim_consecutive"}


def _value_sized(name: str, args) -> bool:
    """Whether the operator's output size depends on its input's values."""
    if name in VALUE_SIZED or (name in ("where", "nonzero_numpy") and len(args) == 1):  # where(condition)
        return True
    return name == "index" and len(args) > 1 and any(  # a boolean mask
        getattr(t, "dtype", None) == torch.bool for t in (args[1] or ()) if t is not None)


def _engine_line() -> str:
    """file:line of the innermost engine frame calling into torch, outside forward_batch's helpers."""
    frame = next((f for f in reversed(traceback.extract_stack()[:-3])
                  if "specdecode_worker" in f.filename and not f.filename.endswith("forward_batch.py")), None)
    return f"{Path(frame.filename).name}:{frame.lineno}" if frame else "?"


class Launches(TorchDispatchMode):
    """Counts kernel-launching operators, Triton launches and host reads while on (``counting``)."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}
        self.reads: dict[str, int] = {}  # host reads by where they happen (file:line)
        self.copies: dict[str, int] = {}  # host-to-device copies by where they happen
        self.counting = False
        self._in_triton = 0
        self._in_read = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        same = name == "to" and args and out is args[0]  # a cast to the dtype it has: no kernel
        if self.counting and not self._in_triton and not self._in_read:
            if name not in NO_KERNEL and not same:
                self.ops[name] = self.ops.get(name, 0) + 1
            if _value_sized(name, args):
                self.read(name)
        return out

    def read(self, what: str) -> None:
        """One host read, keyed by the engine's line that made it."""
        key = f"{_engine_line()} {what}"
        self.reads[key] = self.reads.get(key, 0) + 1

    def copy(self) -> None:
        """One host-to-device copy, keyed by the engine's line that made it."""
        key = _engine_line()
        self.copies[key] = self.copies.get(key, 0) + 1

    @contextlib.contextmanager
    def host_read(self, what: str):
        """A read made of several operators (``to_host``'s one copy, a ``.tolist()``): one read."""
        if self.counting and not self._in_read and not self._in_triton:
            self.read(what)
        self._in_read += 1
        try:
            yield
        finally:
            self._in_read -= 1

    @contextlib.contextmanager
    def triton_launch(self, kernel: str):
        if self.counting and not self._in_triton:
            self.ops[f"triton:{kernel}"] = self.ops.get(f"triton:{kernel}", 0) + 1
        self._in_triton += 1
        try:
            yield
        finally:
            self._in_triton -= 1

    def total(self) -> int:
        return sum(self.ops.values())

    def clear(self) -> None:
        self.ops.clear()
        self.reads.clear()
        self.copies.clear()


@contextlib.contextmanager
def triton_launches_counted(counter: Launches):
    """Each interpreted Triton launch counted once, the operators it runs inside not at all."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        with counter.triton_launch(getattr(self.fn, "__name__", "kernel")):
            return run(self, *args, **kwargs)

    InterpretedFunction.run = counted
    try:
        yield
    finally:
        InterpretedFunction.run = run


@contextlib.contextmanager
def host_traffic_counted(counter: Launches):
    """Host reads that no operator shows on CPU (``.tolist()``, ``to_host``'s copy, ``.numpy()``)
    and host-to-device copies (``forward_batch.host_to_device``, wherever it was imported)."""
    from specdecode_worker.engine import forward_batch
    from specdecode_worker.engine.sampler import batch_sampling

    def reading(name, real):
        def read(self, *args, **kwargs):
            with counter.host_read(name):
                return real(self, *args, **kwargs)
        return read

    def copying(host, device):
        if counter.counting and not counter._in_triton:
            counter.copy()
        return real_copy(host, device)

    real_copy = forward_batch.host_to_device
    saved = [(torch.Tensor, n, getattr(torch.Tensor, n)) for n in ("tolist", "numpy", "item")]
    saved.append((batch_sampling.HostTransfers, "__call__", batch_sampling.HostTransfers.__call__))
    saved += [(m, "host_to_device", real_copy) for m in list(sys.modules.values())
              if getattr(m, "__name__", "").startswith("specdecode_worker")
              and getattr(m, "host_to_device", None) is real_copy]
    try:
        for owner, name, real in saved:
            setattr(owner, name, copying if real is real_copy else reading(
                "to_host" if name == "__call__" else name, real))
        yield
    finally:
        for owner, name, real in saved:
            setattr(owner, name, real)


def count(target: Path, kernels: str) -> dict:
    """Launches in one decode forward at batch 1 after a 16-token prompt: the whole forward, one
    layer, and that layer's attention backend (the KV store and the attention kernels)."""

    with layer_kernels_as(kernels):
        return _count(target)


@contextlib.contextmanager
def layer_kernels_as(kernels: str):
    before = os.environ.get(layer_kernels.LAYER_KERNELS_ENV)
    os.environ[layer_kernels.LAYER_KERNELS_ENV] = kernels
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(layer_kernels.LAYER_KERNELS_ENV)
        else:
            os.environ[layer_kernels.LAYER_KERNELS_ENV] = before


def _count(target: Path) -> dict:
    from specdecode_worker.engine.engine import Engine, EngineArgs

    kernels = os.environ[layer_kernels.LAYER_KERNELS_ENV]
    eng = Engine(EngineArgs(str(target), None, "NONE", device_memory_bytes=3 << 30, mem_fraction_static=0.9,
                            runtime_bytes=0, context_len=512, max_total_tokens=2048, max_running_requests=1,
                            num_draft_tokens=4,
                            dtype="bfloat16"))  # as served: the casts around fp32 reductions are real copies
    eng.init_model_worker()
    model, counter = eng.target_runner.model, Launches()
    layer = model.model.layers[0]
    seen: dict[str, int] = {}

    def measured(key, fn):
        def call(*args, **kwargs):
            before = counter.total()
            out = fn(*args, **kwargs)
            seen[key] = seen.get(key, 0) + counter.total() - before
            return out
        return call

    layer.forward = measured("layer", layer.forward)
    backend = eng.target_runner.backend
    backend.forward = measured("attention", backend.forward)
    model.forward = measured("forward", model.forward)
    req = Request(list(range(5, 21)), SamplingParams(max_tokens=3, ignore_eos=True))
    eng.submit(req)
    with counter, triton_launches_counted(counter):
        eng.step()  # prefill
        seen.clear()
        counter.clear()
        counter.counting = True
        eng.step()  # one decode step
        counter.counting = False
    attention = seen["attention"] // len(model.model.layers)  # the backend serves every layer
    return {"kernels": kernels, "forward": seen["forward"], "layer": seen["layer"], "attention": attention,
            "layer_outside_attention": seen["layer"] - attention, "by_op": dict(sorted(counter.ops.items()))}


@dataclass
class RoundCase:
    """One algorithm's round: its engine, and the draft model it needs (if any)."""

    name: str
    algorithm: str
    target: str  # key into the models
    draft: str | None = None
    topk: int = 1  # EAGLE: more than 1 drafts a tree
    nodes: int = 3  # a tree's nodes verified per round


ROUND_CASES = (RoundCase("plain step", "NONE", "llama"),
               RoundCase("EAGLE3 chain", "EAGLE3", "llama", "eagle3"),
               RoundCase("EAGLE3 tree", "EAGLE3", "llama", "eagle3", topk=3, nodes=6),
               RoundCase("STANDALONE 1B", "STANDALONE", "llama", "llama1b"),
               RoundCase("MTP", "MTP", "deepseek"))
K = 3  # draft tokens (steps) per round


def count_round(case: RoundCase, models: dict[str, Path], rounds: int = 3) -> dict:
    """Launches, host reads and host copies of the ``rounds``-th decode round of one request after a
    16-token prompt, fused layer kernels and Triton attention, every pass eager: the whole round,
    each target and draft forward in it, and the target's layers."""
    with layer_kernels_as("triton"):
        return _count_round(case, models, rounds)


def _count_round(case: RoundCase, models: dict[str, Path], rounds: int) -> dict:
    from specdecode_worker.engine.engine import Engine, EngineArgs

    steps = dict(speculative_num_steps=K, speculative_eagle_topk=case.topk) if case.topk > 1 else {}
    draft = models[case.draft] if case.draft else None
    eng = Engine(EngineArgs(str(models[case.target]), str(draft) if draft else None, case.algorithm,
                            device_memory_bytes=4 << 30, mem_fraction_static=0.9, runtime_bytes=0, context_len=512,
                            max_total_tokens=2048, max_running_requests=1,
                            num_draft_tokens=case.nodes if case.topk > 1 else K,
                            dtype="bfloat16", **steps))
    eng.init_model_worker()
    counter = Launches()
    passes: list[tuple[str, int]] = []
    layers: list[int] = []
    attention: list[int] = []

    def measured(fn, record):
        def call(*args, **kwargs):
            before = counter.total()
            out = fn(*args, **kwargs)
            record(counter.total() - before)
            return out
        return call

    target = eng.target_runner.model
    target.forward = measured(target.forward, lambda n: passes.append(("target", n)))
    for layer in target.model.layers:
        layer.forward = measured(layer.forward, layers.append)
    for backend in {eng.target_runner.backend,
                    getattr(getattr(eng.speculator, "passes", None), "target_tree_backend", None)} - {None}:
        backend.forward = measured(backend.forward, attention.append)
    if eng.draft_runner is not None:
        head = eng.draft_runner.model
        head.forward = measured(head.forward, lambda n: passes.append(("draft", n)))
    tokens = 16 + rounds * (max(case.nodes, K) + 1) + 4
    prompt = [5 + i % 200 for i in range(16)]
    eng.submit(Request(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True)))
    with counter, triton_launches_counted(counter), host_traffic_counted(counter):
        eng.step()  # prefill
        for _ in range(rounds - 1):
            eng.step()
        for log in (passes, layers, attention):
            log.clear()
        counter.clear()
        counter.counting = True
        eng.step()
        counter.counting = False
    in_passes = sum(n for _, n in passes)
    outside = [layer - attn for layer, attn in zip(layers, attention)]  # one attention call per layer
    return {"round": case.name, "algorithm": case.algorithm, "launches": counter.total(),
            "target_passes": [n for who, n in passes if who == "target"],
            "draft_passes": [n for who, n in passes if who == "draft"],
            "outside_passes": counter.total() - in_passes,
            "target_layer_outside_attention": max(outside), "attention_per_layer": max(attention),
            "host_reads": sum(counter.reads.values()), "reads_by_site": dict(sorted(counter.reads.items())),
            "host_copies": sum(counter.copies.values()), "copies_by_site": dict(sorted(counter.copies.items())),
            "by_op": dict(sorted(counter.ops.items()))}


def write_round_models(root: Path, llama: dict = LLAMA_8B_2_LAYERS, draft: dict = LLAMA_1B_2_LAYERS,
                       deepseek: dict = DEEPSEEK_SMALL) -> dict[str, Path]:
    """The rounds' models: the 8B cut (``llama``), an EAGLE3 head for it, the 1B cut (same vocabulary)
    and a DeepSeek-V3 with its NextN layer."""
    from devtools.deepseek_models import write_tiny_deepseek
    from devtools.eagle_heads import write_eagle3_head

    target = write_random_llama(root / "llama", **llama)
    head = write_eagle3_head(root / "eagle3", target, draft_vocab=512, seed=3, aux_layer_ids=[0, 1, 1])
    return {"llama": target, "eagle3": head,
            "llama1b": write_random_llama(root / "llama1b", **draft),
            "deepseek": write_tiny_deepseek(root / "deepseek", mtp=True, **deepseek)}


def write_random_llama(folder: Path, **shape) -> Path:
    """A random Llama checkpoint of ``shape`` (no tokenizer: the count feeds token ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1024, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=3, **shape)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def main() -> int:
    with tempfile.TemporaryDirectory() as root:
        models = write_round_models(Path(root))
        layer_rows = [count(models["llama"], kernels) for kernels in ("torch", "triton")]
        round_rows = [count_round(case, models) for case in ROUND_CASES]
    print(layer_table(layer_rows), end="\n\n")
    print(round_table(round_rows), end="\n\n")
    print(json.dumps({"layers": layer_rows, "rounds": round_rows}, indent=1))
    return 0


def layer_table(rows: list[dict]) -> str:
    lines = ["| layer kernels | launches per forward | per layer | per layer outside attention | attention |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['kernels']} | {r['forward']} | {r['layer']} | {r['layer_outside_attention']} | {r['attention']} |"
              for r in rows]
    return "\n".join(lines)


def round_table(rows: list[dict]) -> str:
    lines = ["| round (k = 3, batch 1) | launches | target passes | draft passes | outside the passes "
             "| per target layer outside attention | host reads | host copies |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        drafts = " + ".join(map(str, r["draft_passes"])) or "none"
        lines.append(f"| {r['round']} | {r['launches']} | {' + '.join(map(str, r['target_passes']))} | {drafts} "
                     f"| {r['outside_passes']} | {r['target_layer_outside_attention']} | {r['host_reads']} "
                     f"| {r['host_copies']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
