"""Command-line pieces ``plan`` and ``serve`` share: the parser that fails in one line, and the
sizing flags, each defined once (``serve`` plans in-process with them when it gets no --plan)."""

from __future__ import annotations

import argparse

from .contract import KV_CACHE_DTYPES
from .errors import InputError


class CommandParser(argparse.ArgumentParser):
    """A flag error is one line and exit code 2 (an InputError), never a usage dump."""

    def error(self, message: str) -> None:
        raise InputError(f"{self.prog}: {message}")


def asks_for_help(argv: list[str]) -> bool:
    """Checked before parsing, so that -h answers even when required flags are missing."""
    return any(a in ("-h", "--help") for a in argv)


def add_sizing_flags(p: argparse.ArgumentParser, serving: bool) -> None:
    """The twelve flags that size a memory plan.

    ``serving``: for ``serve``, where --tp and --kv-cache-dtype default to the --plan's values
    (without a plan: 1 GPU and the compute dtype) instead of ``plan``'s auto.
    """
    p.add_argument("--tp", default=None if serving else "auto",
                   help="tensor-parallel size (one process per GPU, rank 0 serves HTTP), or auto: the smallest "
                   "of 1, 2, 4, 8 that fits" + (" (default: the --plan's, else 1)" if serving else ""))
    p.add_argument("--gpu-memory-gib", type=float, help="free GPU memory before weights, when no GPU is visible")
    p.add_argument("--gpu-product", help="nvidia.com/gpu.product label, e.g. NVIDIA-H100-80GB-HBM3")
    p.add_argument("--mem-fraction-static", default="auto", help="auto or a fraction in (0, 1)")
    p.add_argument("--kv-cache-dtype", default=None if serving else "auto", choices=KV_CACHE_DTYPES,
                   help="K/V pool storage: auto (the compute dtype) or fp8, one byte per element"
                   + (" (default: the --plan's, else auto)" if serving else ""))
    p.add_argument("--context-length", type=int, help="tokens one request may hold (default: the target's)")
    p.add_argument("--min-kv-tokens", type=int, default=0,
                   help="KV token floor; the plan needs max(this, context length)")
    p.add_argument("--max-running-requests", type=int)
    p.add_argument("--cuda-graph-max-bs", type=int)
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument("--max-total-tokens", type=int, help="cap the KV pools at N tokens")
    p.add_argument("--kv-cache-memory-gib", type=float, help="KV budget per GPU (target + draft pools)")
