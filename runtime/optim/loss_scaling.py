"""fp16 dynamic loss scaling, applied to a sharded model's outputs (no change to the training loop)."""

from __future__ import annotations

import math
from typing import Any

import torch


def output_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors in a module output (tensor, tuple/list, dict or Hugging Face ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, tuple | list):
        return [t for item in obj for t in output_tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in output_tensors(item)]
    return []


def not_finite(grad: torch.Tensor) -> torch.Tensor:
    """True (a 0-d bool tensor) where `grad` holds an inf or a NaN.

    [Note: an overflow check by sum] The sum in fp32 of a tensor with an inf or a NaN is not
    finite (NaN propagates, +inf and -inf give NaN), so checking the sum is checking the tensor,
    as DeepSpeed's `CheckOverflow` does: one pass, no temporary. `torch.isfinite(grad).all()`
    makes a bool tensor the size of the gradient first; in host memory that is a fresh mapping
    from 32 Mi elements on, faulted in every step ([Note: glibc's mmap threshold] in
    runtime/host_malloc.py), and its kernel is slow on the CPU, many times the sum's time
    (benchmarks/bench_host_add.py; docs/notes/2026-11-28-runtime-source-notes-moved.md).
    The sum can also overflow where every element is finite, only if they reach about 1e38 / n:
    gradients that large after unscaling are an overflow in all but name, and the step is skipped
    for them as for an inf."""
    return grad.sum(dtype=torch.float32).isfinite().logical_not()


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the incoming gradient by the loss scale in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scaler: DynamicLossScaler) -> torch.Tensor:
        ctx.scale = scaler.scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class DynamicLossScaler:
    """fp16 dynamic loss scaling without touching the training loop.

    The sharded model's outputs pass through `_ScaleGrad`, so whatever loss the user backpropagates
    from them arrives scaled by `scale` (the same as scaling the loss). The optimizer divides the
    gradient shards by it, skips the step and halves the scale on overflow (checked across ranks),
    and doubles it after `growth_interval` clean steps.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale = init_scale
        self.growth_interval = growth_interval
        self._clean_steps = 0

    def scale_outputs(self, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return _ScaleGrad.apply(output, self) if output.requires_grad else output
        if isinstance(output, tuple):
            return type(output)(self.scale_outputs(o) for o in output) if not hasattr(output, "_fields") else \
                type(output)(*(self.scale_outputs(o) for o in output))
        if isinstance(output, list):
            return [self.scale_outputs(o) for o in output]
        if isinstance(output, dict):
            for key in list(output.keys()):
                if output_tensors(output[key]):
                    output[key] = self.scale_outputs(output[key])
            return output
        return output

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "growth_interval": self.growth_interval}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self.growth_interval = int(state["growth_interval"])

    def unscale_and_check(self, grads: list[torch.Tensor], comm: Any) -> bool:
        """Unscale `grads` in place; False (and the scale halved) when any rank saw inf or NaN.

        The flag is a tensor on `comm.device` with several ranks (NCCL all-reduces device tensors
        only), where the gradients are on one; the one host synchronisation of the check is the
        `.item()` at the end."""
        device = comm.device if comm.gather_group is not None or not grads else grads[0].device
        flags = []
        for g in grads:
            g.mul_(1.0 / self.scale)
            flags.append(not_finite(g).to(device))
        found_inf = torch.zeros(1, device=device)
        if flags:
            found_inf = torch.stack(flags).any().float().reshape(1)
        if comm.gather_group is not None:  # None for one rank alone (Comm.local)
            import torch.distributed as dist

            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=comm.gather_group)
        if found_inf.item():
            self.scale = max(self.scale / 2.0, 1.0)
            self._clean_steps = 0
            for g in grads:
                g.zero_()
            return False
        self._clean_steps += 1
        if self._clean_steps % self.growth_interval == 0 and math.isfinite(self.scale * 2):
            self.scale *= 2.0
        return True
