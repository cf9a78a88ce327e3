"""Which models a plan was made for, as ``serve --plan`` checks them before any weight loads.

A plan prices one checkpoint's weights, KV cell and activations; served against another model it
no longer holds (a plan that fits would not be a worker that starts). The plan records, per model
folder it read (``models.target``, and ``models.draft`` for a draft in its own folder), the bytes
of every tensor from the safetensors headers and a short hash of ``config.json``: a few dozen
bytes in the termination message, and a few header reads for the worker. The same files give the
same identity whether read from a folder or a hub (the planner's header copy holds the hub's
``config.json`` and headers verbatim).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable

from ..contract import PlanModel, PlanModels
from ..errors import InputError
from ..model_rules.checkpoint import TensorInfo, read_checkpoint

log = logging.getLogger("specdecode_worker.serve")

CONFIG_HASH_DIGITS = 12  # 48 bits of sha256: tells models apart, keeps the plan small


def config_hash(model_dir: str | Path) -> str:
    """The first hex digits of the sha256 of the folder's ``config.json`` as stored."""
    path = Path(model_dir) / "config.json"
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:CONFIG_HASH_DIGITS]
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def identity(model_dir: str | Path, tensors: Iterable[TensorInfo] | None = None) -> dict[str, Any]:
    """``{"bytes": tensor bytes of the whole checkpoint, "config": config.json's hash}``; ``tensors``:
    the checkpoint's, when already read."""
    tensors = read_checkpoint(model_dir) if tensors is None else tensors
    return {"bytes": sum(t.nbytes for t in tensors), "config": config_hash(model_dir)}


def check_models(target: str, draft: str | None, planned: PlanModels | None, path: str) -> None:
    """Refuse (InputError) a --target or --draft other than the model the plan was made for; warn
    once when the plan does not record its models (a plan from an older planner). ``planned``: the
    plan's ``models``."""
    if planned is None:
        log.warning("the plan %s does not record the models it was made for (a plan from an older planner): "
                    "--target %s%s could not be checked against it; re-plan to have them checked", path, target,
                    f" and --draft {draft}" if draft else "")
        return
    given = {"target": (target, planned.target)}
    if draft and planned.draft and Path(draft).resolve() != Path(target).resolve():
        given["draft"] = (draft, planned.draft)
    for role, (folder, model) in given.items():
        served = identity(folder)
        if served != asdict(model):
            raise InputError(
                f"--{role} {folder}: not the {role} the plan {path} was made for ({_differs(served, model)}); "
                f"re-plan with --{role} {folder}, or give --{role} the folder of the planned model")


def _differs(served: dict[str, Any], planned: PlanModel) -> str:
    parts = []
    if served["config"] != planned.config:
        parts.append(f"config.json hash {served['config']}, planned {planned.config}")
    if served["bytes"] != planned.bytes:
        parts.append(f"weights {served['bytes']} bytes, planned {planned.bytes}")
    return "; ".join(parts)
