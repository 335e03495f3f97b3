"""`shard(model, plan)`: partition a model's parameters across ranks and drive them with hooks.

Construction-time partitioning: a model built on the meta device (`with torch.device("meta")`) is
materialised one unit at a time: the unit's parameters are allocated, initialised, cut into this
rank's shard and dropped, so no more than one operator's full parameters exist at once
(runtime/units/unit_builder.py).

[Note: when a unit is gathered]
forward:  module pre-hook -> prefetch ahead, gather; module post-hook -> reshard, and hook the
          outputs so that their gradient (the start of this module's backward) re-gathers.
backward: output-gradient hook -> prefetch ahead, gather; each parameter's post-accumulate-grad hook
          files its gradient; the unit's last one starts the reduce-scatter and reshards the unit.
          Recompute (runtime/units/recompute.py) re-enters the forward hooks during backward:
          those gather, and release the buffer's memory in place after the use
          ([Note: recompute releases parameters]).
end of backward (autograd callback): start the reduce-scatters of units some of whose parameters
          got no gradient, reshard everything left, phase IDLE. Reduce-scatters finish on the
          rank's reduce worker, and the step waits for them ([Note: a reduce-scatter finishes on
          the reduce worker], in `ShardedModel._start_reduce`).

With more than one rank, every rank must use the same parameters in a backward (as with FSDP): a
unit's reduce-scatter is a collective that all ranks issue in the same order. What autograd saves
and a recompute's use of a unit are in [Note: saved parameters] and [Note: recompute releases
parameters], above `ShardedModel`.
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from planner.specs.plan import Plan
from runtime.ledger import MemoryLedger
from runtime.model_check import check_model
from runtime.optim.loss_scaling import DynamicLossScaler, output_tensors
from runtime.plan_io import RuntimeConfig, resolve_plan, runtime_config
from runtime.profiler import Profiler
from runtime.transfer.collectives import Comm, make_comm
from runtime.transfer.host_worker import HostWorker
from runtime.transfer.stores import ShardStore
from runtime.transfer.trace import WaitKind, hook
from runtime.units.events import UnitListener
from runtime.units.group import ParamUnit, UnitState
from runtime.units.prefetch import Phase, Prefetcher
from runtime.units.recompute import (
    RecomputeInputStore,
    RecomputeSegment,
    apply_recompute,
    find_blocks,
    recompute_input_store_for,
)
from runtime.units.tiling import apply_tiling
from runtime.units.unit_builder import BuiltUnits, build_units, default_init_fn, open_stores

MAX_REDUCES_IN_FLIGHT = 1
"""Reduce-scatters issued and not yet finished on the reduce worker, the one just issued included
(the memory model's `reduce_scatter_buffer`: one operator's full gradients)."""

class StepPhase(enum.Enum):
    IDLE = enum.auto()
    FORWARD = enum.auto()
    BACKWARD = enum.auto()

class _SavedView(NamedTuple):
    """A saved tensor that viewed a unit's transient gathered buffer (see [Note: saved parameters])."""

    unit: ParamUnit
    offset: int
    """Elements from the buffer's first element to the view's."""
    size: torch.Size
    stride: tuple[int, ...]

# [Note: saved parameters]
# Autograd saves what backward needs, and an operator's weight is among it (a Linear's grad input is
# grad_output @ W). What it saves holds the tensor's *storage*: setting `p.data` to an empty tensor at
# reshard does not free the gathered buffer a forward view came from, so without recompute every
# unit's buffer (a read from NVMe, an all-gather output, a cast) stayed alive from its forward to its
# backward, the whole model's parameters at the end of forward, which no memory bill holds. While a
# forward runs, saved tensors therefore go through `saved_tensors_hooks` (pushed outermost, for the
# root's forward): a view of a transient gathered buffer is packed as (unit, offset, size, stride)
# and unpacked as the same view of the buffer the unit is gathered into for its backward (FSDP keeps
# the storage object and refills it instead; a recycled direct-I/O buffer cannot be resized in place).
# Views of a shard that lives in memory (the unit gathers nothing) are saved as they are. Recompute
# segments push torch's own hooks inside ours, so only the tensors saved outside them reach ours, and
# the recompute in backward runs without ours.
#
# [Note: recompute releases parameters]
# A recompute segment's backward first re-runs its forward, and torch's recompute frame keeps what
# that recompute saved (views of the units' gathered buffers) until each operator's backward. Holding
# the buffers that long would keep a whole segment's parameters gathered at once, where the paper's
# schedule (eq. 4) and the memory bill hold one operator; so after its recompute use a unit `hollow`s
# its buffer: the storage object stays (the saved views keep pointing at it) but its memory is freed
# (`resize_(0)`), and the unit's backward gathers again and copies into it (FSDP2 frees and refills
# its unsharded parameters the same way). Only torch allocations can be resized, so before a
# recompute use a direct-I/O read buffer is copied into one (`own_buffer`). A unit whose backward has
# begun (the segment's last, whose output gradient triggered the recompute) is not hollowed.
#
# The gradient of a segment's output reaches the hook on its last operator's output before that
# operator's backward asks for its saved tensors, i.e. before the recompute. Gathering the operator
# there (as for any other unit) held it through the whole recompute, one operator beyond the bill's
# `mswm` (docs/notes/2026-11-22-runtime-source-measurements.md). So a unit whose segment still
# awaits its recompute only marks its backward begun there; the recompute gathers it.
class ShardedModel:
    """Everything the runtime keeps for one sharded module (looked up with `state_of(model)`)."""

    def __init__(self, module: nn.Module, config: RuntimeConfig, comm: Comm, plan: Plan, profiler: Profiler,
                 built: BuiltUnits) -> None:
        self.module_ref = weakref.ref(module)
        self.config = config
        self.comm = comm
        self.plan = plan
        self.profiler = profiler
        self.ledger = profiler.ledger
        # What the builder made (runtime/units/unit_builder.py, where each is described).
        self.copier = built.stores.copier
        self.swap = built.stores.swap
        self.param_store = built.stores.params
        self.grad_store = built.stores.gradients
        self.optimizer_store = built.stores.optimizer_states
        self.units = built.units
        self.masters = built.masters
        self.master_at = built.master_at
        self.transient_buffers = built.transient_buffers
        self.segments: list[RecomputeSegment] = []
        self.recompute_input_store: RecomputeInputStore | None = None
        self.segment_of_unit: dict[int, RecomputeSegment] = {}
        """Unit index -> the recompute segment whose blocks use it."""
        self.prefetcher: Prefetcher | None = None
        self.phase = StepPhase.IDLE
        self.loss_scaler: Any = None
        self._reduces: deque[int] = deque()
        """Transfer-worker tickets of the reduce-scatters in flight ([Note: a reduce-scatter finishes
        on the transfer worker])."""
        self._handles: list[Any] = []
        self.listener = UnitListener()
        """Told about the units' progress: the attached optimizer's schedule ([Note: schedules as
        types] in runtime/units/events.py)."""
        self._forward_tail_reached = False
        self._saving: torch.autograd.graph.saved_tensors_hooks | None = None
        self._kept: dict[int, int] = {}
        """Units this forward keeps gathered for the backward -> their distance into its first
        window ([Note: the forward's tail is the backward's head] in runtime/units/prefetch.py)."""

    def attach(self, listener: UnitListener) -> None:
        """Make `listener` the one told about the units (an optimizer's schedule)."""
        self.check_attachable()
        self.listener.drain()  # a step still overlapping the forward uses the stores
        self.listener = listener

    def check_attachable(self) -> None:
        if not self.listener.replaceable:
            raise ValueError("this model already has an optimizer that steps in backward; create one optimizer "
                             "per sharded model")

    def detach(self, listener: UnitListener) -> None:
        if self.listener is listener:
            self.listener = UnitListener()

    def close(self) -> None:
        """Finish outstanding NVMe transfers and remove the swap directory (also done at exit), and
        let the model go ([Note: closing lets the model go])."""
        try:
            with contextlib.suppress(Exception):  # the optimizer's error is raised by the optimizer, not here
                self.listener.drain()  # an overlapped optimizer step may still be writing the stores
            with contextlib.suppress(Exception):  # a failed landing was reported by the step that waited
                self.copier.wait_transfers()
            for store in self.stores:
                store.close()
            if self.recompute_input_store is not None:
                self.recompute_input_store.close()
            self.copier.close()
        finally:  # after an I/O error too: the swap files must not outlive the run
            if self.swap is not None:
                self.swap.close()
            self._release_model()  # last: the transfers above are done with the model's shards

    def _release_model(self) -> None:
        """[Note: closing lets the model go] Each parameter's post-accumulate-grad hook holds this
        state, and the state holds the parameters (its units): a cycle through the tensors' C++
        hook lists, which the garbage collector cannot see, so a sharded model's state, its stores
        and its process groups lived until the process exited. Closing removes every hook and
        forgets the model, so both are freed once the caller drops them; a later forward is refused
        in one line by the one hook left, which holds nothing of the state."""
        if not self._handles:
            return  # closed before
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        module = self.module_ref()
        if module is not None:
            _STATES.pop(module, None)
            module.register_forward_pre_hook(_refuse_closed, prepend=True)

    @property
    def stores(self) -> list[ShardStore]:
        return [s for s in (self.param_store, self.grad_store, self.optimizer_store) if s is not None]

    # -- hooks ------------------------------------------------------------------------------
    def _use(self, indices: list[int], phase: Phase) -> None:
        assert self.prefetcher is not None
        for i in indices:
            self._kept.pop(i, None)  # used again (the order changed): in use, not kept
            # Buffers change slots here, and each is charged to its new slot's term once all moved.
            with self.ledger.relabelling():
                self.units[i].claim()
                self.prefetcher.on_use(phase, i)  # start gathering ahead before waiting for this one
                if phase is Phase.FORWARD:  # what the forward keeps takes the slot of its backward use
                    for j, ahead in self._kept.items():
                        self.units[j].stage(ahead=ahead)
            if (phase is Phase.FORWARD and not self._forward_tail_reached and torch.is_grad_enabled()
                    and self.prefetcher.window_reaches_end(Phase.FORWARD)):
                self._forward_tail_reached = True
                self.listener.forward_tail()
            self.units[i].unshard()

    @hook("forward pre-hook")
    def root_pre_forward(self, module: nn.Module, args: Any) -> None:  # noqa: ARG002
        if self.phase is StepPhase.IDLE:
            self.listener.forward_begin()
            self._kept = {}
            self._forward_tail_reached = False
            self.phase = StepPhase.FORWARD
            self.profiler.begin("forward")
            if torch.is_grad_enabled() and self._saving is None:
                self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack_saved, self._unpack_saved)
                self._saving.__enter__()

    @hook("forward hook")
    def stop_saving(self, *args: Any) -> None:  # noqa: ARG002 - also a forward hook (always called)
        """Pop the saved-tensor hooks of [Note: saved parameters] (after a forward, or its failure)."""
        if self._saving is not None:
            saving, self._saving = self._saving, None
            saving.__exit__(None, None, None)

    @hook("saved-tensor pack")
    def _pack_saved(self, t: torch.Tensor) -> torch.Tensor | _SavedView:
        if t.layout is not torch.strided or not self.transient_buffers:
            return t
        unit = self.transient_buffers.get(t.untyped_storage().data_ptr())
        if unit is None or t.dtype != unit.full.dtype:
            return t
        offset = t.storage_offset() - unit.full.storage_offset()
        last = offset + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
        if t.numel() == 0 or offset < 0 or last >= unit.full.numel():
            return t
        return _SavedView(unit, offset, t.shape, t.stride())

    @hook("saved-tensor unpack")
    def _unpack_saved(self, saved: torch.Tensor | _SavedView) -> torch.Tensor:
        if not isinstance(saved, _SavedView):
            return saved
        unit = saved.unit
        unit.unshard()  # normally gathered already, by the hook on its outputs' gradients
        full = unit.full
        return full.as_strided(saved.size, saved.stride, full.storage_offset() + saved.offset)

    @hook("forward hook")
    def root_post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:  # noqa: ARG002
        self.stop_saving()
        if self.phase is not StepPhase.FORWARD:
            return output
        self.profiler.end("forward")
        assert self.prefetcher is not None
        self.prefetcher.end_phase(Phase.FORWARD)
        tensors = [t for t in output_tensors(output) if t.requires_grad]
        if not torch.is_grad_enabled() or not tensors:
            self._reshard_all()  # evaluation: no backward is coming
            self.phase = StepPhase.IDLE
            self.profiler.cancel_step()
            return output
        if self.loss_scaler is not None:
            output = self.loss_scaler.scale_outputs(output)
            tensors = [t for t in output_tensors(output) if t.requires_grad]
        torch.autograd.graph.register_multi_grad_hook(tensors, self._begin_backward, mode="any")
        return output

    def pre_forward(self, indices: list[int]) -> Callable[..., None]:
        @hook("forward pre-hook")
        def pre_hook(module: nn.Module, args: Any) -> None:  # noqa: ARG001
            recompute = self.phase is StepPhase.BACKWARD
            self._use(indices, Phase.BACKWARD if recompute else Phase.FORWARD)
            if recompute:  # see [Note: recompute releases parameters]
                for i in indices:
                    self.units[i].own_buffer()

        return pre_hook

    def post_forward(self, indices: list[int]) -> Callable[..., None]:
        @hook("forward hook")
        def post_hook(module: nn.Module, args: Any, output: Any) -> None:  # noqa: ARG001
            for i in indices:  # see [Note: when a unit is gathered]
                if self.phase is StepPhase.BACKWARD:
                    self.units[i].hollow()
                elif not self._keep_for_backward(i):
                    self.units[i].reshard()
            if torch.is_grad_enabled():
                for t in output_tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._pre_backward(indices))

        return post_hook

    def _keep_for_backward(self, index: int) -> bool:
        """[Note: the forward's tail is the backward's head] in runtime/units/prefetch.py."""
        assert self.prefetcher is not None
        ahead = self.prefetcher.keep_distance(index) if torch.is_grad_enabled() else None
        if ahead is None or not self.units[index].keep(ahead=ahead):
            return False
        self._kept[index] = ahead
        return True

    def _pre_backward(self, indices: list[int]) -> Callable[[torch.Tensor], None]:
        @hook("output-gradient hook")
        def pre_backward(grad: torch.Tensor) -> None:  # noqa: ARG001
            self._begin_backward(None)
            for i in indices:
                self.units[i].backward_begun = True
            # See [Note: recompute releases parameters]: the recompute gathers these.
            self._use([i for i in indices if not self._awaits_recompute(i)], Phase.BACKWARD)

        return pre_backward

    def _awaits_recompute(self, index: int) -> bool:
        segment = self.segment_of_unit.get(index)
        return segment is not None and segment.awaits_recompute

    @hook("backward begin")
    def _begin_backward(self, grad: Any) -> None:  # noqa: ARG002
        if self.phase is StepPhase.BACKWARD:
            return
        if self.phase is StepPhase.FORWARD:
            self.profiler.end("forward")  # no-op unless the root hook did not run
        self.phase = StepPhase.BACKWARD
        self._kept = {}  # from here the prefetcher's window charges them ([Note: the forward's tail ...])
        self.profiler.begin("backward")
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self.listener.backward_begin()

    def grad_hook(self, unit: ParamUnit, index: int) -> Callable[[nn.Parameter], None]:
        @hook("post-accumulate-grad hook")
        def gradient_arrived(param: nn.Parameter) -> None:
            grad, param.grad = param.grad, None
            assert grad is not None
            if unit.grads.file(index, grad):
                self._start_reduce(unit)
                unit.reshard()
                if self.comm.world_size == 1:  # with several ranks: once its reduce-scatter is issued
                    self._gradient_final(unit)

        return gradient_arrived

    def _start_reduce(self, unit: ParamUnit) -> None:
        """[Note: a reduce-scatter finishes on the reduce worker]
        With several ranks the hook issues the unit's reduce-scatter (collectives are issued in the
        same order on every rank) and hands its completion to the rank's reduce worker, which waits
        for it (on NCCL the device-to-host stream does, not the host), averages the slice and files
        it: on the device, or off it, the copy then landing on the transfer worker. The unit's
        gradient is final for the optimizer's schedule at once; its consumers wait for those jobs.
        Before issuing one the hook waits, if need be, for the previous one to finish (one full
        gradient buffer in flight, the bill's `reduce_scatter_buffer`): for the network, never for a
        host add, which is the other worker's."""
        worker = self.copier.reduce_worker
        while self._reduces and worker.finished(self._reduces[0]):
            self._reduces.popleft()
        while len(self._reduces) >= MAX_REDUCES_IN_FLIGHT:
            worker.wait(self._reduces.popleft(), kind=WaitKind.BACKPRESSURE)
        reduced = unit.grads.reduce()  # on one rank: nothing to reduce, the count of arrivals starts over
        if reduced is not None:
            self._reduces.append(unit.grads.hand_over_reduce(reduced))
            self._gradient_final(unit)

    def _gradient_final(self, unit: ParamUnit) -> None:
        """The unit's gradient for this backward is complete: the listener may update the unit now
        ([Note: schedules as types] in runtime/units/events.py)."""
        gradient = unit.grads.final()
        if gradient is not None:
            self.listener.gradient_final(unit, gradient)

    @hook("end-of-backward callback")
    def _end_backward(self) -> None:
        for unit in self.units:  # units some of whose parameters got no gradient in this backward
            partial = unit.grads.partial
            self._start_reduce(unit)
            if partial and self.comm.world_size == 1:
                self._gradient_final(unit)
        self._reshard_all()
        for seg in self.segments:
            seg.release()
        assert self.prefetcher is not None
        self.prefetcher.end_phase(Phase.BACKWARD)
        self.phase = StepPhase.IDLE
        self.profiler.end("backward")

    def _reshard_all(self) -> None:
        for unit in self.units:
            unit.reshard()

    def wait_io(self) -> None:
        """Wait for every NVMe transfer in flight (benchmarks time whole steps with it, I/O included);
        buffers stay where they are."""
        self.listener.drain()  # an overlapped optimizer step's updates are transfers in flight too
        self.wait_transfers()
        for store in self.stores:
            store.drain(keep_staging=True)

    def wait_transfers(self, *also: HostWorker) -> None:
        """Wait for the transfer workers (and `also`, an optimizer's): every gradient of the last
        backward landed where it lives. The host's one wait per step, before the optimizer reads them."""
        self.copier.wait_transfers(*also)

    def finish_pending(self) -> None:
        """Called before the optimizer step (a no-op when backward ended normally)."""
        assert self.phase is not StepPhase.BACKWARD, "optimizer step inside backward"
        if self.phase is StepPhase.FORWARD:  # a forward with no backward: drop what it kept gathered
            self._reshard_all()

    # -- gathered views for users (e.g. saving a full state dict) ----------------------------
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, gathered, as fp32 CPU tensors (a collective: all ranks must call it)."""
        module = self.module_ref()
        assert module is not None
        owner = {id(p): u for u in self.units for p in u.params}
        out: dict[str, torch.Tensor] = {}
        for name, p in module.named_parameters():
            unit = owner[id(p)]
            was = unit.state
            unit.unshard()
            out[name] = p.detach().to("cpu", torch.float32).clone()
            if was is UnitState.SHARDED:
                unit.reshard()
        return out

_STATES: weakref.WeakKeyDictionary[nn.Module, ShardedModel] = weakref.WeakKeyDictionary()

def _refuse_closed(module: nn.Module, args: Any) -> None:
    raise RuntimeError(f"this sharded {type(module).__name__} was closed (its shards are gone): "
                       "shard a new model, or load its checkpoint into one")

def state_of(model: nn.Module) -> ShardedModel:
    if model not in _STATES:
        raise ValueError("this model was not sharded: call runtime.shard(model, plan) first")
    return _STATES[model]

def shard(
    model: nn.Module,
    plan: str | Path | dict[str, Any] | Plan,
    *,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    reduce_scatter_method: str | None = None,
) -> nn.Module:
    """Partition `model` under `plan` and return it (the same object, now driven by hooks).

    `param_init_fn(module)` initialises one module's parameters when the model was built on the meta
    device (default: the module's `reset_parameters()`, or a Hugging Face model's `_init_weights`).
    A model that is not the plan's (runtime/model_check.py, [Note: model vs plan]) is refused.
    """
    if model in _STATES:
        raise ValueError("this model is already sharded")
    plan_obj = resolve_plan(plan)
    check_model(model, plan_obj.model)
    comm = make_comm(reduce_scatter_method)
    config = runtime_config(plan_obj, world_size=comm.world_size)
    blocks = find_blocks(model)
    if config.tiling_factor > 1 and blocks is not None:
        apply_tiling(blocks, config.tiling_factor)
    profiler = Profiler(MemoryLedger(), config.device)
    stores = open_stores(model, config, comm, plan_obj, profiler)
    built = build_units(model, config, comm, profiler, stores, param_init_fn or default_init_fn(model))
    state = ShardedModel(model, config, comm, plan_obj, profiler, built)
    module_units = built.module_units
    for store in (state.param_store, state.optimizer_store):
        store.drain()  # the shards' first writes: NVMe staging is given back before training
    for buf_owner in model.modules():  # buffers are small and replicated: just move them
        for name, buf in list(buf_owner._buffers.items()):
            if buf is not None and buf.device != config.device and buf.device.type != "meta":
                buf_owner._buffers[name] = buf.to(config.device)
    state.prefetcher = Prefetcher(state.units, config.prefetch_depth)
    handles = state._handles
    handles.append(model.register_forward_pre_hook(state.root_pre_forward, prepend=True))
    for module, indices in module_units:
        handles.append(module.register_forward_pre_hook(state.pre_forward(indices)))
        handles.append(module.register_forward_hook(state.post_forward(indices)))
    # Registered last so it runs after every module hook of the root itself.
    handles.append(model.register_forward_hook(state.root_post_forward))
    handles.append(model.register_forward_hook(state.stop_saving, always_call=True))  # a failed forward too
    for unit in state.units:
        for index, p in enumerate(unit.params):
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(state.grad_hook(unit, index)))
    if config.recompute_interval > 0 and blocks is not None:
        # A key/value cache filled in forward would be extended again by the recompute (Hugging
        # Face turns it off under gradient checkpointing for the same reason).
        hf_config = getattr(model, "config", None)
        if getattr(hf_config, "use_cache", False):
            hf_config.use_cache = False
        store = recompute_input_store_for(config.placement.recompute_inputs, plan_obj.host_pinning, state.ledger,
                                     state.copier)
        state.recompute_input_store = store
        state.segments = apply_recompute(blocks, config.recompute_interval, store)
        units_of = {id(module): indices for module, indices in module_units}
        state.segment_of_unit = {i: seg for seg in state.segments for block in seg.blocks
                                 for module in block.modules() for i in units_of.get(id(module), ())}
    if config.precision == "fp16":
        state.loss_scaler = DynamicLossScaler()
    _STATES[model] = state
    return model
