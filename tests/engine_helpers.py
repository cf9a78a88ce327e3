"""Shared set-up for engine tests: tiny checkpoints and engines built in three phases."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from specdecode_worker.engine.engine import Engine, EngineArgs

from tests.tiny_models import write_tiny_pair

# Tiny matrices gain nothing from intra-op threads, and on shared CI cores the thread hand-off
# costs more than the arithmetic.
torch.set_num_threads(1)


def tiny_models(root: Path) -> dict[str, Path]:
    """Target, a different random draft, and a byte-for-byte copy of the target."""
    target, draft = write_tiny_pair(root)
    copy = root / "target-copy"
    shutil.copytree(target, copy)
    return {"target": target, "draft": draft, "copy": copy}


def noisy_copy(target: Path, dest: Path, scale: float, seed: int = 0) -> Path:
    """The target with Gaussian noise of ``scale`` x each tensor's spread: a draft that is partly right."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(target, dest)
    weights = load_file(dest / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    noisy = {name: (w.float() + scale * w.float().std() * torch.randn(w.shape, generator=gen)).to(w.dtype)
             for name, w in weights.items()}
    save_file(noisy, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def engine(target, algorithm="NONE", draft=None, **kw) -> Engine:
    args = dict(device_memory_bytes=64 << 20, mem_fraction_static=0.9, runtime_bytes=0, context_len=256,
                max_running_requests=8, num_draft_tokens=4)
    args.update(kw)
    eng = Engine(EngineArgs(str(target), str(draft) if draft else None, algorithm, **args))
    eng.init_model_worker()
    return eng


def run_all(eng: Engine, reqs):
    """Submit every request, then step the engine until all are done (no thread)."""
    for r in reqs:
        eng.submit(r)
    while not all(r.done.is_set() for r in reqs):
        eng.step()
    return reqs


# chi-square critical values at alpha = 0.001 by degrees of freedom
CHI2_CRIT = {3: 16.266, 7: 24.322}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
