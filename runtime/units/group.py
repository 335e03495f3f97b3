"""One unit of gathering: a module's own parameters, sharded, and their gather lifecycle.

A unit is one operator (a Linear, a LayerNorm, an Embedding, or one tile of a tiled Linear): the
granularity at which ZeRO-3 gathers (docs/method.md §4.6 "hooks on every submodule") and at which the
planner counts working memory (eq. 4) and the prefetch set. The module keeps its `nn.Parameter`
objects (so `model.parameters()`, `.dtype` and tied weights still work); only their `.data` points
at a view of the gathered flat buffer while the unit is gathered, and at an empty tensor otherwise.

Split by lifetime, as FSDP2 splits `FSDPParam` from `FSDPParamGroup`: `ParamUnit` here is the
gather lifecycle (stage, gather, claim, keep, hollow, reshard: one forward or backward use); its
gradient filing (`runtime.units.gradients.GradientSink`: one backward) and its ledger accounting
(`runtime.units.unit_charges.UnitCharges`: a buffer's passage through the bill's terms) are its parts.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch
from torch import nn

from planner.specs.memory_terms import MemoryTerm
from runtime.transfer.collectives import Comm, Gathered, all_gather_flat
from runtime.transfer.stores import Pending, ShardStore
from runtime.transfer.streams import DeviceEvent, Streams
from runtime.transfer.trace import Role
from runtime.units.flat_param import FlatLayout
from runtime.units.gradients import GradientSink
from runtime.units.unit_charges import UnitCharges


class UnitState(enum.Enum):
    """What memory a unit holds beyond its shard (which always lives in the params store)."""

    SHARDED = enum.auto()
    """Only the shard. Parameters point at an empty tensor."""
    GATHERING = enum.auto()
    """An all-gather is in flight into a full flat buffer on the compute device (prefetch)."""
    GATHERED = enum.auto()
    """The full flat buffer is valid and every parameter is a view of it."""


STAGE_TERMS = {0: ("gpu", MemoryTerm.MSWM), 1: ("gpu", MemoryTerm.PREFETCH_GATHERED_PARAMS),
               2: ("gpu", MemoryTerm.PREFETCH_SHARD_STAGING), 3: ("cpu", MemoryTerm.PARAM_SWAP_BUFFERS)}
"""Operators ahead of use -> (tier, memory-bill term) of a shard staged that far ahead. A shard read
from NVMe (a store whose states are not resident) lands in a host buffer and stays there until its
all-gather, so from 2 ahead it is one of the host `param_swap_buffers` (`stage_term`)."""


def stage_term(ahead: int, *, resident: bool) -> tuple[str, MemoryTerm]:
    return STAGE_TERMS[ahead if resident or ahead < 2 else 3]


class ParamUnit:
    """A module's flat parameter group: its shard in a store and the full buffer while gathered;
    `grads` files its gradients, `charges` accounts for its buffers."""

    def __init__(
        self,
        *,
        name: str,
        params: list[nn.Parameter],
        layout: FlatLayout,
        comm: Comm,
        param_store: ShardStore,
        grads: GradientSink,
        compute_dtype: torch.dtype,
        charges: UnitCharges,
        link_bytes: dict[str, int],
        transient_buffers: dict[int, ParamUnit] | None = None,
    ) -> None:
        self.name = name
        self.params = params
        self.layout = layout
        self.comm = comm
        self.param_store = param_store
        self.grads = grads
        self.compute_dtype = compute_dtype
        self.charges = charges
        self.link_bytes = link_bytes
        self.state = UnitState.SHARDED
        self._empty = torch.empty(0, dtype=compute_dtype, device=param_store.compute_device)
        self._staged: Pending | None = None
        self._gathering: Gathered | None = None
        self._gathered_on: DeviceEvent | None = None
        """A prefetch issued on the copy stream: the event the compute stream waits on at the unit's
        use ([Note: a prefetch waits on the copy stream])."""
        self._full: torch.Tensor | None = None
        self._full_is_transient = False
        """The gathered buffer is one of its own (a read, a gather or a cast), freed by `reshard`,
        rather than the shard where it lives."""
        self._hollow: torch.Tensor | None = None
        """After a recompute use: the gathered buffer with its memory freed in place, to be refilled
        for the unit's backward ([Note: recompute releases parameters] in runtime/sharding.py)."""
        self._kept = False
        """Gathered past its forward use for the backward (`keep`), until resharded."""
        self.backward_begun = False
        """The unit's own backward began (its outputs' gradient arrived) since it was last resharded."""
        self.await_update: Callable[[bool], bool | Pending] | None = None
        """Set while an overlapped optimizer step has yet to update the unit: whether the update is
        done, waiting for it if asked, or the updated shard itself, handed over by the step instead
        of a read ([Note: the step overlaps the next forward] in runtime/optim/step_schedule.py)."""
        self.transient_buffers = {} if transient_buffers is None else transient_buffers
        """Storage address -> unit, for every gathered buffer that is transient (shared by the model's
        units; see [Note: saved parameters] in runtime/sharding.py)."""

    @property
    def streams(self) -> Streams:
        return self.param_store.copier.streams

    @property
    def num_grad_params(self) -> int:
        return self.grads.num_grad_params

    @property
    def key(self) -> str:
        return self.name

    @property
    def full_bytes(self) -> int:
        return self.layout.padded_numel * self._empty.element_size()

    # -- gather lifecycle ---------------------------------------------------------------------
    def stage(self, *, ahead: int = 2, block: bool | None = None) -> None:
        """Start bringing the shard to the compute device (no-op when it is there). `ahead`: how many
        operators before its use it is, which names the buffer it occupies until it is gathered
        (STAGE_TERMS: 0 the operator in use, 1 the next one, 2 the device staging slot, 3 one of the
        memory model's host `param_swap_buffers`); a shard already on its way is charged to the term
        of its new distance. `block`: wait for an overlapped step's update of the unit (default: at
        its use); without, a shard that update would write is not read yet."""
        if self.state is not UnitState.SHARDED:
            if self._kept:
                self.charges.retag_all(*stage_term(ahead, resident=self.param_store.resident_states))
            return
        if self._staged is None:
            updated = True if self.await_update is None else self.await_update(ahead == 0 if block is None else block)
            if updated is False:
                return  # read ahead once its update is done, or at its use
            self._staged = self.param_store.read(self.key, self.compute_dtype) if updated is True else updated
        elif not self.charges.held:
            return
        if self._staged.fresh:
            self.charges.release()
            self.charges.charge(*stage_term(ahead, resident=self.param_store.resident_states),
                                self.layout.shard_numel * self._empty.element_size())

    def start_gather(self, *, prefetch: bool) -> None:
        """SHARDED -> GATHERING: start the all-gather (after the staged shard arrived). A prefetch on
        one rank whose shard is still on its way leaves it staged ([Note: one rank does not wait
        ahead])."""
        if self.state is not UnitState.SHARDED:
            return
        # A prefetch on one rank may wait for the unit's update later; on several its all-gather is a
        # collective that every rank issues in the same order, so it waits now.
        self.stage(ahead=1 if prefetch else 0, block=not prefetch or self.comm.world_size > 1)
        if self._staged is None:
            return
        if prefetch and self.comm.world_size == 1 and not self._staged.ready():
            return
        side = self.param_store.copier.stream if prefetch else None
        if side is None:
            shard = self._staged.wait()
            self._gathering = all_gather_flat(self.comm, shard, self.link_bytes)
        else:
            shard = self._prefetch_on(side)
        self._full_is_transient = self._gathering.output is not shard or self._staged.fresh
        if self._full_is_transient:
            self.charges.release()
            term = MemoryTerm.PREFETCH_GATHERED_PARAMS if prefetch else MemoryTerm.MSWM
            self.charges.charge("gpu", term, self.full_bytes)
        self._staged = None
        self.state = UnitState.GATHERING

    def _prefetch_on(self, side: Role) -> torch.Tensor:
        """Wait for the staged shard, cast it and issue its all-gather on the copy stream `side`.

        [Note: a prefetch waits on the copy stream]
        A prefetch is issued before the unit in use queues its kernels. Were the compute stream to
        wait for the next unit's copy here (`Pending.wait` orders the *current* stream after it), the
        current unit's kernels would queue behind that copy and copy and compute would serialise. So
        the copy stream does the waiting: for a device shard (last written by the compute stream, an
        optimizer update) it first orders itself after the compute work queued so far; a host or
        NVMe shard's copy was allocated and issued on the copy stream itself
        (`CopyEngine.to_device`), which it then follows; the cast and the all-gather
        (NCCL orders its stream after the current one) follow on it, and an event marks the end. The
        compute stream waits on that event in `unshard`, when the unit is used, and the gathered
        buffer, allocated on the copy stream, is recorded on the compute stream there."""
        assert self._staged is not None
        streams = self.streams
        if not self._staged.on_copy_stream:  # a device shard: after the work that last wrote it
            streams.wait(side, self.param_store.written_event)
        with streams.on(side):
            shard = self._staged.wait()
            self._gathering = all_gather_flat(self.comm, shard, self.link_bytes)
        self._gathered_on = streams.record(side)
        return shard

    def _join(self, gathering: Gathered) -> torch.Tensor:
        """The gathered buffer, the compute stream ordered after the all-gather."""
        if gathering.work is None:
            return gathering.wait()
        return self.streams.join(Role.COMPUTE, gathering.wait, device_side=self.comm.device_side, why="an all-gather")

    @property
    def full(self) -> torch.Tensor:
        """The gathered flat buffer (the unit must be GATHERED)."""
        assert self._full is not None, f"unit {self.name} is not gathered"
        return self._full

    def claim(self) -> None:
        """The unit's use begins: a buffer gathered ahead (or kept from the forward) now counts as
        working memory (eq. 4)."""
        if self.state is UnitState.GATHERED:
            self.charges.retag_all("gpu", MemoryTerm.MSWM)
        else:
            self.charges.retag(MemoryTerm.PREFETCH_GATHERED_PARAMS, MemoryTerm.MSWM)

    def keep(self, *, ahead: int) -> bool:
        """After a forward use: stay gathered for a use `ahead` operators into the backward; from
        now on `stage` charges the gathered buffer to the term of its distance, as it does a staged
        shard ([Note: the forward's tail is the backward's head] in runtime/units/prefetch.py). Only where
        that term holds the whole buffer: from 2 ahead the terms hold a shard, which is the whole
        unit on one rank only. False: reshard instead."""
        if self.state is not UnitState.GATHERED or (ahead >= 2 and self.comm.world_size > 1):
            return False
        self._kept = True
        return True

    def unshard(self) -> None:
        """-> GATHERED: parameters are views of the full buffer and may be used by compute."""
        if self.state is UnitState.GATHERED:
            return
        self.start_gather(prefetch=False)
        assert self._gathering is not None
        gathering, self._gathering = self._gathering, None
        full = self._join(gathering)
        if self._gathered_on is not None:  # [Note: a prefetch waits on the copy stream]
            self.streams.wait(Role.COMPUTE, self._gathered_on)
            self.streams.keep(full, Role.COMPUTE)
            self._gathered_on = None
        if self._hollow is not None:  # refill, in place, the buffer a recompute's saved tensors view
            hollow, self._hollow = self._hollow, None
            hollow.untyped_storage().resize_(full.numel() * full.element_size())
            hollow.copy_(full)
            full = hollow
        self.claim()
        self._set_full(full)
        self.state = UnitState.GATHERED

    @property
    def _recompute_may_release(self) -> bool:
        """Gathered into a buffer of its own, and its own backward has not begun ([Note: recompute
        releases parameters] in runtime/sharding.py)."""
        return self.state is UnitState.GATHERED and self._full_is_transient and not self.backward_begun

    def own_buffer(self) -> None:
        """Before a recompute use: make the transient gathered buffer a torch allocation, whose memory
        `hollow` can free in place (a direct-I/O read buffer is copied into one)."""
        if not self._recompute_may_release or self.full.untyped_storage().resizable():
            return
        owned = torch.empty_like(self.full)
        owned.copy_(self.full)
        self._set_full(owned)  # the read buffer goes back to the recycler
        recycler = self.param_store.recycler
        if recycler is not None:  # and the copy takes its place in the recycler's bound
            self.charges.hold_outside(recycler, self.full_bytes)

    def hollow(self) -> None:
        """After a recompute use: -> SHARDED, freeing the gathered buffer's memory but keeping its
        storage object, which the recompute's saved tensors view; `unshard` refills it in place."""
        if not self._recompute_may_release or not self.full.untyped_storage().resizable():
            return
        full = self.full
        self._set_full(None)
        full.untyped_storage().resize_(0)
        self.charges.release_outside()
        self._hollow = full
        self.charges.release()
        self.state = UnitState.SHARDED

    def reshard(self) -> None:
        """-> SHARDED: drop the full buffer (parameters point at an empty tensor again) and any shard
        staged ahead (after the optimizer step it would be stale)."""
        if self._gathering is not None:  # a prefetch nobody used: let it land before dropping it
            gathering, self._gathering = self._gathering, None
            self._join(gathering)
        self._gathered_on = None
        self._staged = None
        if self.state is not UnitState.SHARDED:
            self._set_full(None)
        self._hollow = None
        self._kept = False
        self.backward_begun = False
        self.charges.release_outside()
        self.charges.release()
        self.state = UnitState.SHARDED

    def _set_full(self, full: torch.Tensor | None) -> None:
        """Make `full` the gathered buffer (None: no buffer): the parameters view it (or an empty
        tensor), and a transient one is registered by its storage address ([Note: saved parameters])."""
        if self._full is not None and self._full_is_transient:
            self.transient_buffers.pop(self._full.untyped_storage().data_ptr(), None)
        self._full = full
        if full is not None and self._full_is_transient:
            self.transient_buffers[full.untyped_storage().data_ptr()] = self
        views = self.layout.views(full) if full is not None else [self._empty] * len(self.params)
        for p, view in zip(self.params, views, strict=True):
            p.data = view
