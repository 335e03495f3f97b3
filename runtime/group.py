"""One unit of gathering: a module's own parameters, sharded, and their gather/reshard/reduce cycle.

A unit is one operator (a Linear, a LayerNorm, an Embedding, or one tile of a tiled Linear): the
granularity at which ZeRO-3 gathers (METHOD.md §4.6 "hooks on every submodule") and at which the
planner counts working memory (eq. 4) and the prefetch set. The module keeps its `nn.Parameter`
objects (so `model.parameters()`, `.dtype` and tied weights still work); only their `.data` points
at a view of the gathered flat buffer while the unit is gathered, and at an empty tensor otherwise.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch import nn

from runtime.collectives import Comm, Gathered, Reduced, all_gather_flat, reduce_scatter_flat
from runtime.flat_param import FlatLayout
from runtime.ledger import MemoryLedger, nbytes
from runtime.stores import Pending, ShardStore


class UnitState(enum.Enum):
    """What memory a unit holds beyond its shard (which always lives in the params store)."""

    SHARDED = enum.auto()
    """Only the shard. Parameters point at an empty tensor."""
    GATHERING = enum.auto()
    """An all-gather is in flight into a full flat buffer on the compute device (prefetch)."""
    GATHERED = enum.auto()
    """The full flat buffer is valid and every parameter is a view of it."""


STAGE_TERMS = {0: ("gpu", "mswm"), 1: ("gpu", "prefetch_gathered_params"), 2: ("gpu", "prefetch_shard_staging"),
               3: ("cpu", "param_swap_buffers")}
"""Operators ahead of use -> (tier, memory-bill term) of a shard staged that far ahead. A shard read
from NVMe (a store whose states are not resident) lands in a host buffer and stays there until its
all-gather, so from 2 ahead it is one of the host `param_swap_buffers` (`stage_term`)."""


def stage_term(ahead: int, *, resident: bool) -> tuple[str, str]:
    return STAGE_TERMS[ahead if resident or ahead < 2 else 3]


class UnitGradient:
    """A unit's final gradient shard for this backward, handed to the optimizer's in-backward update
    instead of being stored ([Note: the optimizer step in backward] in runtime/streamed_optimizer.py).

    `parts` are (element offset in the flat shard, flat tensor): on one rank each parameter's
    gradient as autograd produced it, with several ranks the reduce-scattered shard. Elements no
    part covers (padding, parameters that got no gradient) are zeros, as `settle_grads` makes them."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[tuple[int, torch.Tensor]]) -> None:
        self.parts = parts

    @property
    def device(self) -> torch.device:
        return self.parts[0][1].device if self.parts else torch.device("cpu")

    @property
    def element_size(self) -> int:
        return self.parts[0][1].element_size() if self.parts else 4

    def chunk(self, start: int, numel: int, out: torch.Tensor) -> torch.Tensor:
        """Elements [start, start + numel) as fp32 on `out`'s device: a view of a part when one part
        holds them all in fp32 there (no copy), else copied (and cast) into `out[:numel]`."""
        end = start + numel
        for offset, flat in self.parts:
            if offset <= start and end <= offset + flat.numel() and flat.dtype == torch.float32 \
                    and flat.device == out.device:
                return flat[start - offset : end - offset]
        dst = out[:numel]
        covered = 0
        for offset, flat in sorted(self.parts, key=lambda p: p[0]):
            lo, hi = max(start, offset), min(end, offset + flat.numel())
            if lo >= hi:
                continue
            if lo - start > covered:
                dst[covered : lo - start].zero_()
            dst[lo - start : hi - start].copy_(flat[lo - offset : hi - offset])
            covered = hi - start
        if covered < numel:
            dst[covered:].zero_()
        return dst


class ParamUnit:
    """A module's flat parameter group: shard in a store, full buffer while gathered, gradient path."""

    def __init__(
        self,
        *,
        name: str,
        params: list[nn.Parameter],
        layout: FlatLayout,
        comm: Comm,
        param_store: ShardStore,
        grad_store: ShardStore | None,
        compute_dtype: torch.dtype,
        ledger: MemoryLedger,
        link_bytes: dict[str, int],
        transient_buffers: dict[int, ParamUnit] | None = None,
    ) -> None:
        self.name = name
        self.params = params
        self.layout = layout
        self.comm = comm
        self.param_store = param_store
        self.grad_store = grad_store
        """None when gradients are not stored: each is handed to the optimizer in backward
        (`take_gradient`, `planner.memory.stores_gradients`)."""
        self.compute_dtype = compute_dtype
        self.ledger = ledger
        self.link_bytes = link_bytes
        self.state = UnitState.SHARDED
        self.num_grad_params = sum(p.requires_grad for p in params)
        self._empty = torch.empty(0, dtype=compute_dtype, device=param_store.compute_device)
        self._staged: Pending | None = None
        self._gathering: Gathered | None = None
        self._full: torch.Tensor | None = None
        self._full_is_transient = False
        """The gathered buffer is one of its own (a read, a gather or a cast), freed by `reshard`,
        rather than the shard where it lives."""
        self._hollow: torch.Tensor | None = None
        """After a recompute use: the gathered buffer with its memory freed in place, to be refilled
        for the unit's backward ([Note: recompute releases parameters] in runtime/sharding.py)."""
        self._outside: tuple[Any, int] | None = None
        """(recycler, bytes) while `own_buffer`'s copy stands in for a read buffer in its bound."""
        self._kept = False
        """Gathered past its forward use for the backward (`keep`), until resharded."""
        self.backward_begun = False
        """The unit's own backward began (its outputs' gradient arrived) since it was last resharded."""
        self.transient_buffers = {} if transient_buffers is None else transient_buffers
        """Storage address -> unit, for every gathered buffer that is transient (shared by the model's
        units; see [Note: saved parameters] in runtime/sharding.py)."""
        self._held: list[tuple[str, str, int]] = []
        """(tier, term, bytes) charged for the staged or gathered buffers, released on reshard."""
        self._grad_flat: torch.Tensor | None = None
        self._grads_pending = self.num_grad_params
        self._has_grad_shard = False
        self._grad_written = [False] * len(params)
        """Per parameter: its slice of the gradient shard holds this step's gradient (see
        [Note: lazy gradient zeroing])."""
        self._arrived: dict[int, torch.Tensor] = {}
        """Without a gradient store, on one rank: the gradients of this backward by parameter index,
        until the unit's last one arrives and `take_gradient` hands them over."""
        self._reduced: torch.Tensor | None = None
        """Without a gradient store, with several ranks: the reduced shard `finish_reduce` produced."""

    @property
    def key(self) -> str:
        return self.name

    @property
    def full_bytes(self) -> int:
        return self.layout.padded_numel * self._empty.element_size()

    # -- parameters -------------------------------------------------------------------------
    def stage(self, *, ahead: int = 2) -> None:
        """Start bringing the shard to the compute device (no-op when it is there). `ahead`: how many
        operators before its use it is, which names the buffer it occupies until it is gathered
        (STAGE_TERMS: 0 the operator in use, 1 the next one, 2 the device staging slot, 3 one of the
        memory model's host `param_swap_buffers`); a shard already on its way is charged to the term
        of its new distance."""
        if self.state is not UnitState.SHARDED:
            if self._kept:
                self._retag_all(*stage_term(ahead, resident=self.param_store.resident_states))
            return
        if self._staged is None:
            self._staged = self.param_store.read(self.key, self.compute_dtype)
        elif not self._held:
            return
        if self._staged.fresh:
            self._release_charges()
            self._charge(*stage_term(ahead, resident=self.param_store.resident_states),
                         self.layout.shard_numel * self._empty.element_size())

    def start_gather(self, *, prefetch: bool) -> None:
        """SHARDED -> GATHERING: start the all-gather (after the staged shard arrived). A prefetch on
        one rank whose shard is still on its way leaves it staged ([Note: one rank does not wait
        ahead])."""
        if self.state is not UnitState.SHARDED:
            return
        self.stage(ahead=1 if prefetch else 0)
        assert self._staged is not None
        if prefetch and self.comm.world_size == 1 and not self._staged.ready():
            return
        shard = self._staged.wait()
        self._gathering = all_gather_flat(self.comm, shard, self.link_bytes)
        self._full_is_transient = self._gathering.output is not shard or self._staged.fresh
        if self._full_is_transient:
            self._release_charges()
            self._charge("gpu", "prefetch_gathered_params" if prefetch else "mswm", self.full_bytes)
        self._staged = None
        self.state = UnitState.GATHERING

    @property
    def full(self) -> torch.Tensor:
        """The gathered flat buffer (the unit must be GATHERED)."""
        assert self._full is not None, f"unit {self.name} is not gathered"
        return self._full

    def claim(self) -> None:
        """The unit's use begins: a buffer gathered ahead (or kept from the forward) now counts as
        working memory (eq. 4)."""
        if self.state is UnitState.GATHERED:
            self._retag_all("gpu", "mswm")
        else:
            self._retag("prefetch_gathered_params", "mswm")

    def keep(self, *, ahead: int) -> bool:
        """After a forward use: stay gathered for a use `ahead` operators into the backward; from
        now on `stage` charges the gathered buffer to the term of its distance, as it does a staged
        shard ([Note: the forward's tail is the backward's head] in runtime/prefetch.py). Only where
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
        full = self._gathering.wait()
        self._gathering = None
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
            self._release_outside()
            recycler.hold_outside(self.full_bytes)
            self._outside = (recycler, self.full_bytes)

    def hollow(self) -> None:
        """After a recompute use: -> SHARDED, freeing the gathered buffer's memory but keeping its
        storage object, which the recompute's saved tensors view; `unshard` refills it in place."""
        if not self._recompute_may_release or not self.full.untyped_storage().resizable():
            return
        full = self.full
        self._set_full(None)
        full.untyped_storage().resize_(0)
        self._release_outside()
        self._hollow = full
        self._release_charges()
        self.state = UnitState.SHARDED

    def reshard(self) -> None:
        """-> SHARDED: drop the full buffer (parameters point at an empty tensor again) and any shard
        staged ahead (after the optimizer step it would be stale)."""
        if self._gathering is not None:  # a prefetch nobody used: let it land before dropping it
            self._gathering.wait()
            self._gathering = None
        self._staged = None
        if self.state is not UnitState.SHARDED:
            self._set_full(None)
        self._hollow = None
        self._kept = False
        self.backward_begun = False
        self._release_outside()
        self._release_charges()
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

    # -- gradients --------------------------------------------------------------------------
    def on_grad(self, index: int, param: nn.Parameter) -> bool:
        """File a parameter's gradient, complete for this backward. True when it was the unit's last,
        i.e. the unit's backward is over: reduce its gradients and reshard it."""
        grad = param.grad
        param.grad = None
        assert grad is not None
        self._grads_pending -= 1
        if self.grad_store is None:
            if self.comm.world_size == 1:
                assert index not in self._arrived, f"unit {self.name}: a second gradient for parameter {index}"
                self._arrived[index] = grad
                return self._grads_pending == 0
        else:
            self._ensure_grad_shard()
        if self.comm.world_size == 1:
            # The flat vector is the shard: write (first) or add (later) straight into the store.
            offset = self.layout.offsets[index]
            if self._grad_written[index]:
                self.grad_store.accumulate(self.key, grad, offset).wait()
            else:
                self.grad_store.write(self.key, grad, offset).wait()
                self._grad_written[index] = True
        else:
            if self._grad_flat is None:
                self._grad_flat = torch.zeros(self.layout.padded_numel, dtype=grad.dtype, device=grad.device)
                self.ledger.add("gpu", "mswm", nbytes(self._grad_flat))
            self._grad_flat[self.layout.param_slice(index)].copy_(grad.reshape(-1))
        return self._grads_pending == 0

    def reduce_grads(self) -> Reduced | None:
        """Start the reduce-scatter of whatever gradients arrived (all of them, normally)."""
        self._grads_pending = self.num_grad_params
        flat, self._grad_flat = self._grad_flat, None
        if flat is None:
            return None
        self.ledger.sub("gpu", "mswm", nbytes(flat))
        self.ledger.add("gpu", "reduce_scatter_buffer", nbytes(flat))
        return reduce_scatter_flat(self.comm, flat, self.link_bytes)

    def finish_reduce(self, reduced: Reduced) -> Pending:
        """Average the reduced slice and add it into the gradient shard where it lives (without a
        gradient store: keep it for `take_gradient`)."""
        out = reduced.wait()
        out.div_(self.comm.world_size)
        if self.grad_store is None:
            self.ledger.sub("gpu", "reduce_scatter_buffer", self.layout.padded_numel * out.element_size())
            self._reduced = out
            return Pending(out)
        if all(self._grad_written):
            pending = self.grad_store.accumulate(self.key, out)
        else:
            pending = self.grad_store.write(self.key, out)
            self._grad_written = [True] * len(self.params)
        self.ledger.sub("gpu", "reduce_scatter_buffer", self.layout.padded_numel * out.element_size())
        return pending

    @property
    def grads_partial(self) -> bool:
        """Some but not all of the unit's gradients arrived in this backward (so far)."""
        return 0 < self.num_grad_params - self._grads_pending < self.num_grad_params

    def take_gradient(self) -> UnitGradient | None:
        """Without a gradient store: this backward's gradient shard, handed over once (None when
        nothing arrived)."""
        if self._reduced is not None:
            out, self._reduced = self._reduced, None
            return UnitGradient([(0, out.reshape(-1))])
        if not self._arrived:
            return None
        arrived, self._arrived = self._arrived, {}
        self._grads_pending = self.num_grad_params
        return UnitGradient([(self.layout.offsets[i], g.reshape(-1)) for i, g in arrived.items()])

    def _ensure_grad_shard(self) -> None:
        """Gradient shards are created by the first backward, not at construction: a model is built
        holding its parameter shards only (construction-time partitioning, METHOD.md §4.6)."""
        if not self._has_grad_shard:
            self.grad_store.create(self.key, self.layout.shard_numel, torch.float32)
            self._has_grad_shard = True

    @property
    def grad_received(self) -> bool:
        """Whether any gradient arrived since `zero_grad` (torch's optimizers skip a parameter whose
        `.grad` is None: no decay, no momentum step; the optimizer does the same per unit)."""
        return any(self._grad_written)

    def grad_shard(self) -> torch.Tensor:
        """The exact gradient shard where it lives (zeros for parameters that got no gradient)."""
        self._ensure_grad_shard()
        self.settle_grads()
        return self.grad_store.resident(self.key)

    def zero_grad(self) -> None:
        """[Note: lazy gradient zeroing] Zeroing is a promise, not a memset: the next gradient to
        arrive overwrites its slice instead of adding to it, which saves two passes over the
        gradient shards per step. Slices nobody wrote are zeroed by `settle_grads` before use."""
        self._grad_written = [False] * len(self.params)

    def settle_grads(self) -> None:
        """Make the gradient shard exact: zero the slices that received nothing since `zero_grad`."""
        if all(self._grad_written) or not self._has_grad_shard:
            return
        if self.comm.world_size == 1:
            for index, written in enumerate(self._grad_written):
                if not written:
                    part = self.layout.param_slice(index)
                    self.grad_store.zero(self.key, part.start, part.stop - part.start)
        else:
            self.grad_store.zero(self.key, 0, self.layout.shard_numel)
        self._grad_written = [True] * len(self.params)

    # -- accounting -------------------------------------------------------------------------
    def _charge(self, tier: str, term: str, num_bytes: int) -> None:
        self.ledger.add(tier, term, num_bytes)
        self._held.append((tier, term, num_bytes))

    def _retag(self, old: str, new: str) -> None:
        for i, (tier, term, b) in enumerate(self._held):
            if term == old:
                self.ledger.sub(tier, old, b)
                self.ledger.add("gpu", new, b)
                self._held[i] = ("gpu", new, b)

    def _retag_all(self, tier: str, term: str) -> None:
        held, self._held = self._held, []
        for old_tier, old_term, b in held:
            self.ledger.sub(old_tier, old_term, b)
            self._charge(tier, term, b)

    def _release_outside(self) -> None:
        if self._outside is not None:
            recycler, num_bytes = self._outside
            self._outside = None
            recycler.release_outside(num_bytes)

    def _release_charges(self) -> None:
        for tier, term, b in self._held:
            self.ledger.sub(tier, term, b)
        self._held = []
