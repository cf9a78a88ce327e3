"""Peak bytes of tensors alive at once, counted on CPU: a stand-in for CUDA's allocator peak
(``max_memory_allocated``) over a piece of code, without the allocator's rounding."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Within ``with LiveBytes() as m``: ``m.peak`` is the most bytes of storages made inside the
    block that were alive at one time (storages made before it, and views of them, are not counted)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if key in self._seen or size == 0:
            return
        self._seen.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)

        def freed(key=key, size=size):
            self._seen.discard(key)
            self.live -= size

        weakref.finalize(storage, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view or an in-place result shares an input's storage: nothing new was allocated
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self._track(t)
        return out
