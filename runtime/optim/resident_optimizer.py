"""AdamW over fp32 master shards resident in memory (device or host): torch's fused AdamW.

The masters are leaf views of the shards (torch's optimizer needs Parameters; they share storage),
so the update is in place; where the master is a separate copy (mixed precision, or the
parameters on another tier) the updated master is written back into the parameter store, cast
to the compute precision.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from planner.specs.memory_terms import MemoryTerm
from runtime.ledger import nbytes
from runtime.optim.optimizer_engine import AdamWEngine
from runtime.units.gradients import FinalGradient
from runtime.units.group import ParamUnit


class ResidentAdamW(AdamWEngine):
    """`torch.optim.AdamW` over the fp32 masters of a sharded model's units, in the optimizer store's tier."""

    def __init__(self, model: Any, units: list[ParamUnit], *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, fused: bool | None = None) -> None:
        self.model = model
        self._keys = [u.key for u in units]
        self._masters = [nn.Parameter(model.masters[k], requires_grad=True) for k in self._keys]
        self._master_of = dict(zip(self._keys, self._masters, strict=True))
        store = model.optimizer_store
        device = store.compute_device if store.tier == "gpu" else torch.device("cpu")
        if fused is None:
            fused = device.type in ("cpu", "cuda")
        self._inner = torch.optim.AdamW(self._masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                        fused=fused)
        self._states_charged = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._inner.param_groups

    def step(self, units: list[ParamUnit]) -> bool:
        model = self.model
        grads = [u.grads.final().flat() for u in units]
        if model.loss_scaler is not None and not model.loss_scaler.unscale_and_check(grads, model.comm):
            return False
        stepped = [self._master_of[u.key] for u in units]
        for master, grad in zip(stepped, grads, strict=True):
            master.grad = grad
        self._inner.step()
        for master in self._masters:
            master.grad = None
        self._updated_in_place()
        self._charge_states()
        for unit in units:
            self._write_back(unit.key)
        return True

    def update_unit(self, unit: ParamUnit, gradient: FinalGradient) -> None:
        master = self._master_of[unit.key]
        master.grad = gradient.flat()
        try:
            self._inner.step()  # torch skips the masters whose .grad is None: only this one steps
        finally:
            master.grad = None
        self._updated_in_place()
        self._charge_states()
        gradient.spent()
        self._write_back(unit.key)

    def _updated_in_place(self) -> None:
        """Where the masters are the parameter shards, a later read of them follows this update."""
        if self.model.config.master_shares_param_shard:
            self.model.param_store.mark_updated()

    def _write_back(self, key: str) -> None:
        """The compute copy of the parameters, where it is not the master itself."""
        model = self.model
        if not model.config.master_shares_param_shard:
            write = model.param_store.write if model.optimizer_store.on_device else model.param_store.write_host
            write(key, model.masters[key]).wait()

    def _charge_states(self) -> None:
        """Momentum and variance exist from the first step on (torch allocates them lazily)."""
        if self._states_charged:
            return
        tier = self.model.optimizer_store.tier
        for master in self._masters:
            for value in self._inner.state[master].values():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    self.model.ledger.add(tier, MemoryTerm.OPTIMIZER_STATES, nbytes(value))
        self._states_charged = True

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._inner.load_state_dict(state_dict)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Adam's momentum, variance and step per unit (where torch keeps them)."""
        out = {}
        for key, master in zip(self._keys, self._masters, strict=True):
            for name, value in self._inner.state.get(master, {}).items():
                out[f"adam/{key}/{name}"] = value
        return out

    def checkpoint_bytes(self) -> int:
        return sum(2 * m.numel() * m.element_size() + 4 for m in self._masters)

    def checkpoint_tensors_for_load(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Creates the Adam states a fresh optimizer has not allocated yet (torch creates them lazily
        on the first step)."""
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
