"""AdamW over the fp32 master shards, stepping where the optimizer states live.

Each rank updates only its shards (ZeRO-3): master weights, momentum and variance sit in the
optimizer store (device or host memory), the gradients were reduce-scattered into the gradient
store of the same tier (placement rules in `planner.plan.Placement`), and the updated master is
written back into the parameter store (cast to the compute precision) when it is a separate copy.
The update itself is torch's fused AdamW: on CPU it runs at ~1.7 G params/s on 2 threads
(DESIGN.md reference measurements), faster than anything we would hand-write here.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from runtime.group import ParamUnit, UnitGradient
from runtime.ledger import nbytes
from runtime.sharding import ShardedModel, _tensors, state_of
from runtime.streamed_optimizer import StreamedAdamW


class AdamW:
    """`torch.optim.AdamW` semantics on a sharded model: `step()`, `zero_grad()`, `param_groups`."""

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        fused: bool | None = None,
    ) -> None:
        self.state: ShardedModel = state_of(model)
        st = self.state
        self._keys = [u.key for u in st.units if u.num_grad_params]
        self._units = {u.key: u for u in st.units}
        self.num_skipped_steps = 0
        self.in_backward = st.config.optimizer_step == "in_backward"
        """Each unit is updated in backward as soon as its gradient is final ([Note: the optimizer step
        in backward] in runtime/streamed_optimizer.py); `step()` finishes what is left."""
        self._updated: set[str] = set()
        """Units updated in this step's backward (in-backward only)."""
        self._streamed: StreamedAdamW | None = None
        if self.in_backward:
            if st.unit_gradient_ready is not None:
                raise ValueError("this model already has an optimizer that steps in backward; create one optimizer "
                                 "per sharded model")
            st.unit_gradient_ready = self._update_unit
        if not st.optimizer_store.resident_states:
            # States that do not fit in memory are streamed through a few chunk buffers.
            self._streamed = StreamedAdamW(st, self._keys, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                           in_backward=self.in_backward)
            return
        # Leaf views of the master shards: torch's optimizer needs Parameters; they share storage.
        self._masters = [nn.Parameter(st.masters[k], requires_grad=True) for k in self._keys]
        self._master_of = dict(zip(self._keys, self._masters, strict=True))
        device = st.optimizer_store.compute_device if st.optimizer_store.tier == "gpu" else torch.device("cpu")
        if fused is None:
            fused = device.type in ("cpu", "cuda")
        self._inner = torch.optim.AdamW(self._masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                        fused=fused)
        self._states_charged = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._streamed.param_groups if self._streamed is not None else self._inner.param_groups

    def state_dict(self) -> dict[str, Any]:
        self._refuse_streamed("state_dict")
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._refuse_streamed("load_state_dict")
        self._inner.load_state_dict(state_dict)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The optimizer's tensors that are not shards of the model's stores, by stable name, for
        training checkpoints (runtime/ckpt): per-unit step counts, and Adam's momentum and variance
        where torch keeps them (in-memory states; streamed states live in the optimizer store)."""
        if self._streamed is not None:
            return {f"streamed/{k}/step": self._streamed.steps[k] for k in self._keys}
        out = {}
        for key, master in zip(self._keys, self._masters, strict=True):
            for name, value in self._inner.state.get(master, {}).items():
                out[f"adam/{key}/{name}"] = value
        return out

    def checkpoint_bytes(self) -> int:
        """Bytes of `checkpoint_tensors()` once every unit has stepped (Adam's states appear lazily)."""
        if self._streamed is not None:
            return 4 * len(self._keys)
        return sum(2 * m.numel() * m.element_size() + 4 for m in self._masters)

    def checkpoint_tensors_for_load(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Tensors to load the named checkpoint tensors into, creating Adam states that a fresh
        optimizer has not allocated yet (torch creates them lazily on the first step)."""
        if self._streamed is not None:
            return self.checkpoint_tensors()
        master_by_name = {str(k): m for k, m in self._master_of.items()}  # names carry str(UnitKey)
        for name in names:
            parts = name.split("/")
            master = master_by_name.get(parts[1]) if len(parts) == 3 and parts[0] == "adam" else None
            what = parts[-1]
            if master is None or what not in ("exp_avg", "exp_avg_sq", "step"):
                continue  # the loader reports names that match nothing
            state = self._inner.state[master]
            if what == "step":
                # torch's fused AdamW keeps the step as a float32 scalar on the parameter's device.
                state.setdefault("step", torch.zeros((), dtype=torch.float32, device=master.device))
            else:
                state.setdefault(what, torch.zeros_like(master, memory_format=torch.preserve_format))
        return self.checkpoint_tensors()

    def _refuse_streamed(self, what: str) -> None:
        if self._streamed is not None:
            raise ValueError(f"{what} of optimizer states on NVMe is not supported; place optimizer_states on cpu "
                             "to save or load them")

    def close(self) -> None:
        """Free the streamed step's chunk buffers (no-op for in-memory states)."""
        if self.state.unit_gradient_ready == self._update_unit:
            self.state.unit_gradient_ready = None
        if self._streamed is not None:
            self._streamed.close()

    @torch.no_grad()
    def _update_unit(self, unit: ParamUnit, gradient: UnitGradient | None) -> None:
        """In backward: update `unit` with its final gradient (`gradient`, or its stored shard)."""
        key = unit.key
        if key in self._updated:
            raise RuntimeError(
                f"unit {key} got a second gradient before optimizer.step(): the plan's optimizer_step is in_backward, "
                "which updates each unit once per backward and cannot accumulate gradients over several; call "
                "optimizer.step() after every backward, or set optimizer_step to after_backward")
        self._updated.add(key)
        if self._streamed is not None:
            assert gradient is not None
            self._streamed.update_unit(key, gradient)
            return
        master = self._master_of[key]
        master.grad = unit.grad_shard()
        try:
            self._inner.step()  # torch skips the masters whose .grad is None: only this one steps
        finally:
            master.grad = None
        self._charge_states()
        unit.zero_grad()  # spent: the next backward overwrites it, whatever the loop does
        if not self.state.master_shares_param_shard:
            self.state.param_store.write(key, self.state.masters[key]).wait()

    @torch.no_grad()
    def step(self) -> bool:
        """Update the shards; returns False when an fp16 overflow made the step be skipped."""
        st = self.state
        st.finish_pending()
        st.profiler.begin("optimizer")
        if self.in_backward:  # every unit with a gradient was updated in backward: what is left are writes
            self._updated.clear()
            if self._streamed is not None:
                self._streamed.finish_in_backward()
            st.profiler.end("optimizer")
            st.profiler.end_step()
            return True
        live = [self._units[k].grad_received for k in self._keys]
        if self._streamed is not None:
            self._streamed.step([k for k, used in zip(self._keys, live, strict=True) if used])
            st.profiler.end("optimizer")
            st.profiler.end_step()
            return True
        grads = [self._units[k].grad_shard() for k, used in zip(self._keys, live, strict=True) if used]
        applied = True
        if st.loss_scaler is not None:
            applied = st.loss_scaler.unscale_and_check(grads, st.comm)
        if applied:
            stepped = [m for m, used in zip(self._masters, live, strict=True) if used]
            for master, grad in zip(stepped, grads, strict=True):
                master.grad = grad
            self._inner.step()
            for master in self._masters:
                master.grad = None
            self._charge_states()
            if not st.master_shares_param_shard:
                for k, used in zip(self._keys, live, strict=True):
                    if used:
                        st.param_store.write(k, st.masters[k]).wait()
        else:
            self.num_skipped_steps += 1
        st.profiler.end("optimizer")
        st.profiler.end_step()
        return applied

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 - shards are always kept
        if self.state.grad_store is None:
            return  # gradients are handed to the in-backward update, never kept
        for k in self._keys:
            self._units[k].zero_grad()

    def _charge_states(self) -> None:
        """Momentum and variance exist from the first step on (torch allocates them lazily)."""
        if self._states_charged:
            return
        tier = self.state.optimizer_store.tier
        for master in self._masters:
            for value in self._inner.state[master].values():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    self.state.ledger.add(tier, "optimizer_states", nbytes(value))
        self._states_charged = True


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
                if _tensors(output[key]):
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
        found_inf = torch.zeros(1)
        for g in grads:
            g.mul_(1.0 / self.scale)
            if not torch.isfinite(g).all():
                found_inf.fill_(1.0)
        if comm.world_size > 1:
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
