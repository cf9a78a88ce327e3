"""What the Triton kernel tests share: on a GPU the kernels run compiled; without one they run under
Triton's interpreter, which must be on before triton is first imported (tests/conftest.py turns it
on for the whole session; this covers a file run without it)."""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    if "triton" in sys.modules:
        raise RuntimeError("triton was imported before the Triton kernel tests could turn on its interpreter; "
                           "run them in their own pytest process")
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
# fp8 e4m3 has a Triton type from sm_89 on (the interpreter has it everywhere)
E4M3_ON_DEVICE = not CUDA or torch.cuda.get_device_capability() >= (8, 9)
