"""Device memory for the plan, in order of trust: the GPU itself (pynvml), an explicit size, or a
catalogue of GPU products keyed by the ``nvidia.com/gpu.product`` node label.

The catalogue's numbers are the total memory the driver reports (``nvidia-smi``, MiB) for each
product. An idle GPU reports less than that free: the driver keeps some for itself (615 MiB on an
H200 with driver 580: total 143,771 MiB, free 143,156 MiB, used 0). The usable bytes of a product,
what the plan budgets against without a GPU at hand, are its total minus that reservation.
The operator imports ``GPU_PRODUCTS`` / ``product_memory_bytes`` too, so this module has no
dependencies beyond the standard library (pynvml is imported lazily and is optional).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .contract import GIB, MIB
from .errors import InputError

# Memory the driver reserves on an idle GPU (measured on an H200, driver 580.159).
DRIVER_RESERVED_BYTES = 615 * MIB

# nvidia.com/gpu.product label value -> total memory in MiB as the driver reports it.
GPU_PRODUCTS: dict[str, int] = {
    "NVIDIA-B200": 183_359,
    "NVIDIA-H200": 143_771,
    "NVIDIA-H200-NVL": 143_771,
    "NVIDIA-H100-80GB-HBM3": 81_559,
    "NVIDIA-H100-PCIe": 81_559,
    "NVIDIA-H100-NVL": 95_830,
    "NVIDIA-A100-SXM4-80GB": 81_920,
    "NVIDIA-A100-80GB-PCIe": 81_920,
    "NVIDIA-A100-SXM4-40GB": 40_960,
    "NVIDIA-A100-PCIE-40GB": 40_960,
    "NVIDIA-L40S": 46_068,
    "NVIDIA-L40": 46_068,
    "NVIDIA-L4": 23_034,
    "NVIDIA-A10G": 23_028,
    "NVIDIA-A10": 23_028,
    "Tesla-T4": 15_360,
}


# PyTorch's default cuBLAS workspace, one per (handle, stream) pair, from its caching allocator
# (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize): 32 MiB on sm_90, as cuBLAS
# recommends for Hopper, else 4096 KiB x 2 + 16 KiB x 8. CUBLAS_WORKSPACE_CONFIG changes it.
HOPPER_BLAS_WORKSPACE_BYTES = 4096 * 8 * 1024
BLAS_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
# The catalogue's sm_90 products (a GPU it does not name gets Hopper's size anyway).
HOPPER_PRODUCTS = ("NVIDIA-H100", "NVIDIA-H200")


def _normalise(label: str) -> str:
    return label.strip().replace(" ", "-").upper()


_BY_NORMALISED = {_normalise(k): v for k, v in GPU_PRODUCTS.items()}


def product_total_bytes(label: str) -> int | None:
    """Total memory in bytes of the GPU product named by a ``nvidia.com/gpu.product`` label, else None."""
    mib = _BY_NORMALISED.get(_normalise(label))
    return None if mib is None else mib * MIB


def product_memory_bytes(label: str) -> int | None:
    """Usable memory in bytes (total minus the driver's reservation) of the GPU product named by a
    ``nvidia.com/gpu.product`` label, else None: what an idle GPU of that product reports free.

    Matching ignores case and treats spaces as dashes (``NVIDIA H100 80GB HBM3`` is what pynvml
    names the product the label calls ``NVIDIA-H100-80GB-HBM3``). MIG slices (``...-MIG-1g.10gb``)
    are not in the catalogue and return None.
    """
    total = product_total_bytes(label)
    return None if total is None else total - DRIVER_RESERVED_BYTES


def blas_workspace_bytes(name: str) -> int:
    """One cuBLAS workspace on the GPU ``name`` (a product label or pynvml's name): Hopper's size
    for Hopper and for a GPU the catalogue does not know (the larger, so a plan stays safe)."""
    label = _normalise(name)
    if label in _BY_NORMALISED and not label.startswith(HOPPER_PRODUCTS):
        return BLAS_WORKSPACE_BYTES
    return HOPPER_BLAS_WORKSPACE_BYTES


@dataclass(frozen=True)
class DeviceMemory:
    """Memory of one GPU as the plan sees it."""

    total_bytes: int
    free_bytes: int
    source: str  # "nvml", "override" or "catalogue"
    name: str

    @property
    def used_bytes(self) -> int:
        return self.total_bytes - self.free_bytes


def _visible_index() -> int | None:
    """First GPU this process may use: None when CUDA_VISIBLE_DEVICES hides them all."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return 0
    first = visible.split(",")[0].strip()
    if first == "" or first.startswith("-"):
        return None
    return int(first) if first.isdigit() else 0


def nvml_memory(index: int | None = None) -> DeviceMemory | None:
    """Total and free memory of the first visible GPU from pynvml, or None without a usable GPU."""
    index = _visible_index() if index is None else index
    if index is None:
        return None
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no GPU here
        return None
    try:
        if pynvml.nvmlDeviceGetCount() <= index:
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
        return DeviceMemory(total_bytes=int(info.total), free_bytes=int(info.free), source="nvml", name=name)
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def resolve_device_memory(
    gpu_memory_gib: float | None = None, gpu_product: str | None = None, use_nvml: bool = True
) -> DeviceMemory:
    """The memory to plan against: the visible GPU, else ``--gpu-memory-gib``, else the catalogue.

    An explicit ``--gpu-memory-gib`` is taken as the memory free before any weight is loaded and
    wins over the catalogue; a visible GPU wins over both because it is the real thing.
    """
    if use_nvml:
        found = nvml_memory()
        if found is not None:
            return found
    if gpu_memory_gib is not None:
        if not gpu_memory_gib > 0:
            raise InputError(f"--gpu-memory-gib: must be a positive number of GiB, got {gpu_memory_gib}")
        size = int(gpu_memory_gib * GIB)
        return DeviceMemory(total_bytes=size, free_bytes=size, source="override", name=f"{gpu_memory_gib:g} GiB")
    if gpu_product is not None:
        total = product_total_bytes(gpu_product)
        if total is None:
            known = ", ".join(sorted(GPU_PRODUCTS))
            raise InputError(
                f"--gpu-product: unknown GPU product {gpu_product!r}; known: {known}; "
                "or give the memory with --gpu-memory-gib"
            )
        return DeviceMemory(total_bytes=total, free_bytes=total - DRIVER_RESERVED_BYTES, source="catalogue",
                            name=gpu_product)
    raise InputError(
        "no GPU visible: give the GPU with --gpu-product (an nvidia.com/gpu.product label) "
        "or its free memory with --gpu-memory-gib"
    )
