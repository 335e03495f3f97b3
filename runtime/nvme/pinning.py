"""The CUDA pin hook for `BufferPool`: page-locks pool buffers with cudaHostRegister.

Kept out of buffers.py so that the NVMe package imports without torch; only a runtime that has
CUDA builds one. Registering memory we allocated (rather than allocating pinned tensors) keeps a
single aligned pool serving both the direct-I/O engine and fast host<->device copies.
"""

from __future__ import annotations


class TorchCudaPinHook:
    """`PinHook` backed by `torch.cuda.cudart()`; raises RuntimeError with the CUDA error code."""

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("pinning host buffers needs CUDA; build the pool without a pin hook on CPU")
        self._cudart = torch.cuda.cudart()

    def pin(self, address: int, nbytes: int) -> None:
        status = self._cudart.cudaHostRegister(address, nbytes, 0)
        if int(status) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes at {address:#x} failed with CUDA error {int(status)}")

    def unpin(self, address: int) -> None:
        status = self._cudart.cudaHostUnregister(address)
        if int(status) != 0:
            raise RuntimeError(f"cudaHostUnregister at {address:#x} failed with CUDA error {int(status)}")
