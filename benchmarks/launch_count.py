"""Kernel launches per decode step, counted on CPU: Llama-3.1-8B's geometry cut to 2 layers, bf16, batch 1.

On a GPU a batch-1 decode step is mostly launches: an H200 ran 1,519 kernels per step of the 8B
target, 6.5 ms of work and ~1.5 ms of gaps for 3.6 ms of weight reads (docs/gpu-data-path.md).
This counts, for one decode forward, the operators that launch a kernel on a GPU (views and empty
allocations excluded) and the Triton kernels (each one launch; counted under TRITON_INTERPRET=1, the
operators the interpreter runs inside a kernel excluded), twice: with the layer's elementwise work
as torch ops (``SPECDECODE_LAYER_KERNELS=torch``) and as this project's fused kernels (the CUDA
default). Attention is the Triton backend in both, as on a GPU. A count is not a time: a cuBLAS
matrix product may launch a split-K reduction beside it, and the GPU run shows what each costs.

    TRITON_INTERPRET=1 .venv/bin/python benchmarks/launch_count.py
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
os.environ.setdefault("SPECDECODE_ATTENTION_BACKEND", "triton")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "worker",):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from specdecode_worker.engine.kernels import layer_kernels  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402

LLAMA_8B_2_LAYERS = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                         num_key_value_heads=8, max_position_embeddings=2048, rope_theta=500000.0)
# Operators that make no kernel: views, metadata and allocations.
NO_KERNEL = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "as_strided", "t", "transpose",
             "permute", "unsqueeze", "squeeze", "detach", "alias", "split", "split_with_sizes", "unbind",
             "narrow", "diagonal", "_reshape_alias", "lift_fresh", "empty", "empty_like", "empty_strided",
             "new_empty", "new_empty_strided", "_local_scalar_dense", "is_nonzero", "sym_size", "sym_stride",
             "sym_numel", "sym_storage_offset", "dim", "size", "stride"}


class Launches(TorchDispatchMode):
    """Counts kernel-launching operators and Triton launches while on (``counting``)."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}
        self.counting = False
        self._in_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        same = name == "to" and args and out is args[0]  # a cast to the dtype it has: no kernel
        if self.counting and not self._in_triton and name not in NO_KERNEL and not same:
            self.ops[name] = self.ops.get(name, 0) + 1
        return out

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


def count(target: Path, kernels: str) -> dict:
    """Launches in one decode forward at batch 1 after a 16-token prompt: the whole forward, one
    layer, and that layer's attention backend (the KV store and the attention kernels)."""

    before = os.environ.get(layer_kernels.LAYER_KERNELS_ENV)
    os.environ[layer_kernels.LAYER_KERNELS_ENV] = kernels
    try:
        return _count(target)
    finally:
        if before is None:
            os.environ.pop(layer_kernels.LAYER_KERNELS_ENV)
        else:
            os.environ[layer_kernels.LAYER_KERNELS_ENV] = before


def _count(target: Path) -> dict:
    from specdecode_worker.engine.engine import Engine, EngineArgs

    kernels = os.environ[layer_kernels.LAYER_KERNELS_ENV]
    eng = Engine(EngineArgs(str(target), None, "NONE", device_memory_bytes=3 << 30, mem_fraction_static=0.9,
                            runtime_bytes=0, context_len=512, max_running_requests=1, num_draft_tokens=4,
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
        counter.ops.clear()
        counter.counting = True
        eng.step()  # one decode step
        counter.counting = False
    attention = seen["attention"] // len(model.model.layers)  # the backend serves every layer
    return {"kernels": kernels, "forward": seen["forward"], "layer": seen["layer"], "attention": attention,
            "layer_outside_attention": seen["layer"] - attention, "by_op": dict(sorted(counter.ops.items()))}


def write_random_llama(folder: Path, **shape) -> Path:
    """A random Llama checkpoint of ``shape`` (no tokenizer: the count feeds token ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1024, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=3, **shape)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def main() -> int:
    with tempfile.TemporaryDirectory() as root:
        target = write_random_llama(Path(root) / "llama8b-2", **LLAMA_8B_2_LAYERS)
        rows = []
        for kernels in ("torch", "triton"):
            rows.append(count(target, kernels))
    print("| layer kernels | launches per forward | per layer | per layer outside attention | attention |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernels']} | {r['forward']} | {r['layer']} | {r['layer_outside_attention']} | {r['attention']} |")
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
