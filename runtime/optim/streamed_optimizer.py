"""The optimizer step with the optimizer states on NVMe: chunked and pipelined (docs/method.md §4.3).

Every unit's fp32 master, Adam momentum and variance, and its gradient shard are cut into chunks of
`chunk_numel` elements (a unit's chunks start at multiples of it, so reads and writes stay 4 KiB
aligned). One chunk occupies one buffer of the plan's pool (`optimizer_chunk_bytes` each,
`num_optimizer_buffers` of them), laid out as four equal regions: master | exp_avg | exp_avg_sq |
grad. With three buffers the step runs

    read chunk k+1   |   update chunk k (torch's fused AdamW)   |   write chunk k-1

concurrently: reads and writes are asynchronous engine requests, the update runs on the calling thread
(the optimizer worker: in backward, or after it, overlapping the next forward unit by unit, [Note: the
step overlaps the next forward] in runtime/optim/step_schedule.py).
With B > 3 buffers the reads run B-2 chunks ahead (k+1 .. k+B-2).
The pool is allocated once, so host memory for the states never exceeds
`num_optimizer_buffers * optimizer_chunk_bytes` however large the model on disk.

The arithmetic is the same kernel `torch.optim.AdamW(fused=True)` runs over the whole shard
(elementwise, so chunking does not change a bit; `tests/test_nvme_training.py` checks it).
The step's first chunks are read during backward ([Note: reading the next step's states ahead]), and
with `optimizer_step: in_backward` each unit is updated as its gradient is final ([Note: the
optimizer step in backward]); both notes are above `StreamedAdamW`.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from planner.specs.memory_terms import MemoryTerm
from runtime.nvme import AlignedBuffer, BufferPool
from runtime.optim.chunk_read_ahead import REGIONS, Chunk, ChunkReadAhead, chunk_numel_for
from runtime.optim.optimizer_engine import AdamWEngine
from runtime.transfer.nvme_store import NvmeStore
from runtime.transfer.stores import Pending, ShardStore, StateKey
from runtime.units.gradients import FinalGradient
from runtime.units.group import ParamUnit


# [Note: reading the next step's states ahead]
# The fp32 master, momentum and variance of the step's first chunks (as many as the pool has buffers
# for, B - 1) are read into the pool during backward, one chunk each time a unit's gradient is final,
# so that those reads overlap backward instead of starting when `step()` is called; the gradient
# region of those chunks is read at the step, since backward writes it. Backward, not the end of the
# previous step: there the reads compete with the forward's parameter reads, which a computation is
# waiting for (docs/notes/2026-11-22-runtime-source-measurements.md). The states only change in a
# step, so the copies stay exact unless something else writes the stores in between (loading a
# training checkpoint): the stores count their writes, and a step whose stores were written since
# the prefetch drops it and reads afresh. Chunks prefetched for units that got no gradient this
# step are dropped too.
#
# [Note: the optimizer step in backward]
# With `optimizer_step: in_backward` in the plan, a unit is updated as soon as its gradient is final
# (its last parameter's gradient arrived on one rank, its reduce-scatter finished on several) instead
# of at `optimizer.step()`: the update's state traffic (read 3 fp32 states, write 3 per parameter)
# and its CPU work then overlap the rest of the backward, and the gradient goes from autograd (or
# the reduce-scatter) straight into the update, never to the gradient store: 2 bytes of NVMe traffic
# per fp32 parameter byte fewer (the gradient's write and its read back) and no gradient swap file.
# Later systems do this to hide the CPU optimizer (docs/method.md §6; PyTorch's "optimizer in backward"
# recipe, ZenFlow, SuperOffload). After backward, a step whose backward is compute-bound pays for
# compute plus the whole state traffic instead of the larger of the two
# (docs/notes/2026-11-25-nvme-slower-cpu.md).
#
# The update itself runs on the optimizer worker thread, so the backward of the units before goes
# on while a unit is updated: its gradient reaches the worker as autograd (or the reduce-scatter)
# produced it, or, on CUDA, copied off the device on the copy stream into pinned staging by the
# hook, and the worker waits for that copy ([Note: the optimizer worker] in
# runtime/optim/optimizer_worker.py, which also says which thread owns the read-ahead when).
#
# The schedule: once the forward has submitted its last parameter read (or, before the forward's
# order is recorded, when the backward begins), the states of the first chunks in the order the
# previous step updated them (reversed unit order before any step) are read into the pool, filling
# the drive while the forward's last operators compute; each update takes
# its chunk's buffer, waits for its reads, updates with the gradient (a view of it where it already
# is fp32 host memory, else cast into the buffer's gradient region), submits the chunk's writes,
# and reads further ahead into every buffer that is free or whose write has landed, never waiting
# for a write (backward's compute is not held up for a read-ahead). A chunk that is not the one
# expected (a changed order) drops the read-ahead and is read on demand. `optimizer.step()` then
# only waits for the last writes. All three read ahead through one mechanism, `ChunkReadAhead`
# ([Note: one read-ahead] in runtime/optim/chunk_read_ahead.py). The read-ahead starts at the forward's tail, not at backward begin,
# because the drive is idle while the forward's last operators compute
# (docs/notes/2026-11-22-runtime-source-measurements.md).
#
# It is exact (bitwise the after-backward step: same gradients, same kernel, same order per element)
# for the loop it is meant for: one backward per step, no gradient clipping (which needs the global
# norm of every gradient first) and no fp16 loss scaling (refused in the plan). A second backward
# before `optimizer.step()` (gradient accumulation) raises instead of updating twice.
class StreamedAdamW(AdamWEngine):
    """AdamW over shards that live in stores not resident in memory (the `nvme` optimizer tier)."""

    def __init__(self, model: Any, units: list[ParamUnit], *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, fused: bool | None = None) -> None:  # noqa: ARG002 - always torch's fused kernel
        self.model = model
        self.keys = [u.key for u in units]
        self.chunk_numel = chunk_numel_for(model.plan.optimizer_chunk_bytes)
        # Pinned on a device: the in-backward update copies each gradient chunk off it into its buffer.
        self.pool = BufferPool(buffer_bytes=REGIONS * 4 * self.chunk_numel, num_buffers=model.plan.num_optimizer_buffers,
                               pin_hook=model.copier.streams.pin_hook(MemoryTerm.OPTIMIZER_SWAP_BUFFERS))
        # Unpinned before its memory goes, also when the optimizer is dropped without close().
        weakref.finalize(self, self.pool.close)
        model.ledger.add("cpu", MemoryTerm.OPTIMIZER_SWAP_BUFFERS, self.pool.total_bytes)
        store: ShardStore = model.optimizer_store
        self.units = {u.key: u for u in units}
        self.numels = {u.key: u.layout.shard_numel for u in units}
        for k, numel in self.numels.items():
            for name in ("exp_avg", "exp_avg_sq"):
                store.create(StateKey(name, k), numel, torch.float32)  # zeros, like torch's lazy init
        self.param_groups = [{"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}]
        self.steps = {k: torch.tensor(0.0) for k in self.keys}
        """Per-unit step count (torch keeps one per parameter; a unit is stepped as one)."""
        self.read_ahead = ChunkReadAhead(self.pool, self._write_stamp)
        # The step's first chunks are read during backward where every state store is one to read ahead from.
        streamed = all(isinstance(s, NvmeStore) for s in self._state_stores())
        self._step_head = self._chunks(self.keys)[: self.pool.num_buffers - 1] if streamed else []
        """The chunks read during backward for the after-backward step ([Note: reading the next step's
        states ahead])."""
        self._order: list[str] = list(reversed(self.keys))
        """In backward: units in the order the last step updated them (the guess before any step: reversed)."""
        self._updated: list[str] = []
        """Units updated in this backward, in order."""
        self._group: dict[str, Any] | None = None
        """The hyperparameters of the after-backward step in progress, taken at its start."""
        self._queued = 1
        """The after-backward step's chunks read or reading ahead of the one updated."""

    # -- after backward -----------------------------------------------------------------------
    def step(self, units: list[ParamUnit]) -> bool:
        self.begin_step(units)
        try:
            for unit in units:
                self.step_unit(unit)
        finally:
            self.end_step()
        return True

    def begin_step(self, units: list[ParamUnit]) -> None:
        """Start the after-backward step of `units` (on the main thread: the gradients are settled and
        the hyperparameters taken now, so the units may then be stepped on the optimizer worker while
        the next forward runs; [Note: the step overlaps the next forward] in runtime/optim/step_schedule.py)."""
        for unit in units:
            unit.grads.settle()
        self._group = dict(self.param_groups[0])
        chunks = self._chunks([u.key for u in units])
        # States read during backward get their gradient region now: backward wrote it.
        for chunk, buffer, pendings in self.read_ahead.resume(chunks, self._read):
            pendings.append(self._read_grad(chunk, buffer))
        # With B buffers, chunks i+1 .. i+B-2 are read while chunk i is updated and the writes of
        # earlier chunks drain (a buffer is freed by retiring the oldest write). Three buffers give
        # read k+1 | update k | write k-1.
        self._queued = max(1, self.pool.num_buffers - 2) + 1 if self.pool.num_buffers > 1 else 1

    def step_unit(self, unit: ParamUnit, updated: torch.Tensor | None = None) -> list[Pending]:
        """Update `unit`'s chunks, the next of the step begun by `begin_step`, and submit their writes;
        returns those writes (the caller may wait for them: waiting again when retired is a no-op).
        `updated`: also copy the updated fp32 master into it (see `hands_updated_shard`)."""
        ahead = self.read_ahead
        chunks = self._chunks([unit.key])
        if chunks:  # a unit with no elements on this rank is not stepped (the chunked loop's count)
            self.steps[unit.key] += 1
        writes: list[Pending] = []
        for chunk in chunks:
            ahead.fill(limit=self._queued, wait=True)
            buffer = self._claim(chunk)
            self._update(chunk, buffer, None)
            writes += ahead.writes[-1][1]
            if updated is not None:  # the buffer is reused only once its write landed: still the update's
                updated[chunk.start : chunk.start + chunk.numel].copy_(self._views(buffer, chunk.numel)[0])
        return writes

    def hands_updated_shard(self, unit: ParamUnit) -> bool:
        """Whether `unit`'s updated fp32 master is, byte for byte, the shard the next forward reads back
        from the drive: fp32 parameters on NVMe that are their own master, computed on the CPU. Then
        the overlapped step can hand the forward a copy of it instead ([Note: the step overlaps the
        next forward] in runtime/optim/step_schedule.py)."""
        model = self.model
        store, key = model.master_at[unit.key]
        return (store is model.param_store and key == unit.key and isinstance(store, NvmeStore)
                and unit.compute_dtype == torch.float32 and not model.copier.separate_memory)

    def end_step(self) -> None:
        """Let the step's writes land (also after a failed `step_unit`)."""
        self._group = None
        try:
            self.read_ahead.retire_writes()
        finally:
            self.read_ahead.stop()  # only left with reads when the step failed
            # Let the writes land. The gradients' write staging stays for the next backward (the
            # bill's gradient_swap_buffers); that of the compute copies of the parameters (mixed
            # precision) is given back, since the forward's reads need the room.
            self.model.grad_store.drain(keep_staging=True)
            self.model.param_store.drain()

    @property
    def overlaps_forward(self) -> bool:
        """The after-backward step may run on the optimizer worker during the next forward: on the
        CPU, where the update writes host stores only (on CUDA the compute stream would have to
        follow the worker's copies, as in backward: not done)."""
        return not self.model.copier.separate_memory

    def prefetch_for_step(self) -> None:
        """A unit's gradient is final: read the master and Adam states of the next of the step's first
        chunks (see [Note: reading the next step's states ahead])."""
        ahead = self.read_ahead
        if ahead.since is None:
            ahead.start(self._step_head, self._read_states)
        ahead.fill(limit=len(ahead.queue) + 1)

    # -- in backward ([Note: the optimizer step in backward]) ----------------------------------
    def begin_updates(self) -> None:
        """Start reading the states of the first updates ahead, in the order of the last step."""
        self._updated = []
        self.read_ahead.start(self._chunks(self._order), self._read_states)
        self.read_ahead.fill()

    def backward_begin(self) -> None:
        if self.read_ahead.stale:  # not started at the forward's tail, or the stores were written since
            self.begin_updates()

    def update_unit(self, unit: ParamUnit, gradient: FinalGradient) -> None:
        """Update `unit` now, with its final gradient of this backward (on the optimizer worker)."""
        key = unit.key
        self.steps[key] += 1
        self._updated.append(key)
        for chunk in self._chunks([key]):
            self._update(chunk, self._claim(chunk), gradient)
            self.read_ahead.fill()

    def end_updates(self) -> None:
        """At `optimizer.step()`: let the updates' writes land; what was read ahead for units that got
        no gradient is dropped; the order of this step's updates is the next step's guess."""
        try:
            self.read_ahead.drop()
            self.read_ahead.retire_writes()
        finally:
            if self._updated:
                self._order = self._updated
            self._updated = []
            self.read_ahead.since = None
            self.model.param_store.drain()

    # -- both -----------------------------------------------------------------------------------
    def _claim(self, chunk: Chunk) -> AlignedBuffer:
        """`chunk`'s buffer, once its reads landed."""
        buffer, pendings = self.read_ahead.claim(chunk)
        for p in pendings:
            p.wait()
        return buffer

    def _update(self, chunk: Chunk, buffer: AlignedBuffer, gradient: FinalGradient | None) -> None:
        """Update `chunk` in its buffer with `gradient` (None: the gradient region, read from the
        gradient store) and submit its writes."""
        master, exp_avg, exp_avg_sq, grad = self._views(buffer, chunk.numel)
        if gradient is not None:  # on the host: the in-backward hook staged a device gradient
            assert gradient.device.type == "cpu", gradient.device
            grad = gradient.chunk(chunk.start, chunk.numel, grad)
        self._adamw(chunk.key, master, grad, exp_avg, exp_avg_sq)
        self.read_ahead.writes.append((buffer, self._write(chunk, buffer)))

    @property
    def chunk_pool(self) -> BufferPool:
        return self.pool

    def state_dict(self) -> dict[str, Any]:
        raise self._refusal("state_dict")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: ARG002
        raise self._refusal("load_state_dict")

    @staticmethod
    def _refusal(what: str) -> ValueError:
        return ValueError(f"{what} of optimizer states on NVMe is not supported; place optimizer_states on cpu "
                          "to save or load them")

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Per-unit step counts (the states themselves are shards of the optimizer store)."""
        return {f"streamed/{k}/step": self.steps[k] for k in self.keys}

    def checkpoint_bytes(self) -> int:
        return 4 * len(self.keys)

    def checkpoint_tensors_for_load(self, names: list[str]) -> dict[str, torch.Tensor]:  # noqa: ARG002
        return self.checkpoint_tensors()

    def close(self) -> None:
        self.read_ahead.drop()
        self.read_ahead.retire_writes()
        self.model.ledger.sub("cpu", MemoryTerm.OPTIMIZER_SWAP_BUFFERS, self.pool.total_bytes)
        self.pool.close()

    # -- internals --------------------------------------------------------------------------
    def _chunks(self, keys: list[str]) -> list[Chunk]:
        return [Chunk(k, s, min(self.chunk_numel, self.numels[k] - s))
                for k in keys for s in range(0, self.numels[k], self.chunk_numel)]

    def _state_stores(self) -> list[ShardStore]:
        stores = {id(s): s for s in [self.model.optimizer_store, *(s for s, _ in self.model.master_at.values())]}
        return list(stores.values())

    def _write_stamp(self) -> tuple[int, ...]:
        return tuple(s.num_writes for s in self._state_stores() if isinstance(s, NvmeStore))

    def _adamw(self, key: str, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor) -> None:
        group = self.param_groups[0] if self._group is None else self._group
        torch._fused_adamw_([master], [grad], [exp_avg], [exp_avg_sq], [], [self.steps[key]],
                            amsgrad=False, lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    def _views(self, buffer: AlignedBuffer, numel: int) -> list[torch.Tensor]:
        flat = torch.frombuffer(buffer.view, dtype=torch.float32)
        n = self.chunk_numel
        return [flat[r * n : r * n + numel] for r in range(REGIONS)]

    def _read(self, chunk: Chunk, buffer: AlignedBuffer) -> list[Pending]:
        return [*self._read_states(chunk, buffer), self._read_grad(chunk, buffer)]

    def _read_states(self, chunk: Chunk, buffer: AlignedBuffer) -> list[Pending]:
        """The fp32 master and the Adam states of `chunk` (everything but its gradient)."""
        master, exp_avg, exp_avg_sq, _ = self._views(buffer, chunk.numel)
        master_store, master_key = self.model.master_at[chunk.key]
        opt = self.model.optimizer_store
        return [master_store.read_into(master_key, master, chunk.start),
                opt.read_into(StateKey("exp_avg", chunk.key), exp_avg, chunk.start),
                opt.read_into(StateKey("exp_avg_sq", chunk.key), exp_avg_sq, chunk.start)]

    def _read_grad(self, chunk: Chunk, buffer: AlignedBuffer) -> Pending:
        grad = self._views(buffer, chunk.numel)[3]
        return self.model.grad_store.read_into(chunk.key, grad, chunk.start)

    def _write(self, chunk: Chunk, buffer: AlignedBuffer) -> list[Pending]:
        model = self.model
        master, exp_avg, exp_avg_sq, _ = self._views(buffer, chunk.numel)
        master_store, master_key = model.master_at[chunk.key]
        opt = model.optimizer_store
        out = [master_store.write_from(master_key, master, chunk.start),
               opt.write_from(StateKey("exp_avg", chunk.key), exp_avg, chunk.start),
               opt.write_from(StateKey("exp_avg_sq", chunk.key), exp_avg_sq, chunk.start)]
        if master_key != chunk.key:  # a separate compute copy of the parameters (mixed precision)
            out.append(model.param_store.write_host(chunk.key, master.to(model.config.compute_dtype), chunk.start))
        return out
