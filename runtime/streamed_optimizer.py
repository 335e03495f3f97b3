"""The optimizer step with the optimizer states on NVMe: chunked and pipelined (METHOD.md §4.3).

Every unit's fp32 master, Adam momentum and variance, and its gradient shard are cut into chunks of
`chunk_numel` elements (a unit's chunks start at multiples of it, so reads and writes stay 4 KiB
aligned). One chunk occupies one buffer of the plan's pool (`optimizer_chunk_bytes` each,
`num_optimizer_buffers` of them), laid out as four equal regions: master | exp_avg | exp_avg_sq |
grad. With three buffers the step runs

    read chunk k+1   |   update chunk k (torch's fused AdamW)   |   write chunk k-1

concurrently: reads and writes are asynchronous engine requests, the update runs on this thread.
With B > 3 buffers the reads run B-2 chunks ahead (k+1 .. k+B-2).
The pool is allocated once, so host memory for the states never exceeds
`num_optimizer_buffers * optimizer_chunk_bytes` however large the model on disk.

[Note: reading the next step's states ahead]
The fp32 master, momentum and variance of the step's first chunks (as many as the pool has buffers
for, B - 1) are read into the pool during backward, one chunk each time a unit's backward is over,
so that those reads overlap backward instead of starting when `step()` is called; the gradient
region of those chunks is read at the step, since backward writes it. Backward, not the end of the
previous step: there the reads compete with the forward's parameter reads, which a computation is
waiting for (docs/notes/2026-11-22-runtime-source-measurements.md). The states only change in a
step, so the copies stay exact unless something else writes the stores in between (loading a
training checkpoint): the stores count their writes, and a step whose stores were written since
the prefetch drops it and reads afresh. Chunks prefetched for units that got no gradient this
step are dropped too.

The arithmetic is the same kernel `torch.optim.AdamW(fused=True)` runs over the whole shard
(elementwise, so chunking does not change a bit; `tests/test_nvme_training.py` checks it).

[Note: the optimizer step in backward]
With `optimizer_step: in_backward` in the plan, a unit is updated as soon as its gradient is final
(its last parameter's gradient arrived on one rank, its reduce-scatter finished on several) instead
of at `optimizer.step()`: the update's state traffic (read 3 fp32 states, write 3 per parameter)
and its CPU work then overlap the rest of the backward, and the gradient goes from autograd (or
the reduce-scatter) straight into the update, never to the gradient store: 2 bytes of NVMe traffic
per fp32 parameter byte fewer (the gradient's write and its read back) and no gradient swap file.
Later systems do this to hide the CPU optimizer (METHOD.md §6; PyTorch's "optimizer in backward"
recipe, ZenFlow, SuperOffload). After backward, a step whose backward is compute-bound pays for
compute plus the whole state traffic instead of the larger of the two
(docs/notes/2026-11-25-nvme-slower-cpu.md).

The schedule: once the forward has submitted its last parameter read (or, before the forward's
order is recorded, when the backward begins), the states of the first chunks in the order the
previous step updated them (reversed unit order before any step) are read into the pool, filling
the drive while the forward's last operators compute; each update takes
its chunk's buffer, waits for its reads, updates with the gradient (a view of it where it already
is fp32 host memory, else copied into the buffer's gradient region), submits the chunk's writes,
and reads further ahead into every buffer that is free or whose write has landed, never waiting
for a write (backward's compute is not held up for a read-ahead). A chunk that is not the one
expected (a changed order) drops the read-ahead and is read on demand. `optimizer.step()` then
only waits for the last writes. The read-ahead starts at the forward's tail, not at backward begin,
because the drive is idle while the forward's last operators compute
(docs/notes/2026-11-22-runtime-source-measurements.md).

It is exact (bitwise the after-backward step: same gradients, same kernel, same order per element)
for the loop it is meant for: one backward per step, no gradient clipping (which needs the global
norm of every gradient first) and no fp16 loss scaling (refused in the plan). A second backward
before `optimizer.step()` (gradient accumulation) raises instead of updating twice.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from runtime.group import UnitGradient
from runtime.nvme import AlignedBuffer, BufferPool
from runtime.nvme.pinning import TorchCudaPinHook
from runtime.nvme_store import NvmeStore
from runtime.stores import Pending, ShardStore

REGIONS = 4
"""master, exp_avg, exp_avg_sq, grad."""
ALIGN_NUMEL = 1024
"""fp32 elements per 4 KiB: chunk boundaries at multiples of this keep direct I/O aligned."""


def chunk_numel_for(chunk_bytes: int) -> int:
    """Elements per chunk so that the four fp32 regions fit one buffer of `chunk_bytes`."""
    numel = chunk_bytes // (REGIONS * 4)
    if numel >= ALIGN_NUMEL:
        numel -= numel % ALIGN_NUMEL
    assert numel > 0, chunk_bytes
    return numel


@dataclass(frozen=True, slots=True)
class _Chunk:
    key: str
    start: int
    numel: int


class StreamedAdamW:
    """AdamW over shards that live in stores not resident in memory (the `nvme` optimizer tier)."""

    def __init__(self, state: Any, keys: list[str], *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, in_backward: bool = False) -> None:
        self.state = state
        self.keys = keys
        plan = state.plan
        self.chunk_numel = chunk_numel_for(plan.optimizer_chunk_bytes)
        # Pinned on CUDA: the in-backward update copies each gradient chunk off the GPU into its buffer.
        pin_hook = TorchCudaPinHook() if state.config.device.type == "cuda" else None
        self.pool = BufferPool(buffer_bytes=REGIONS * 4 * self.chunk_numel, num_buffers=plan.num_optimizer_buffers,
                               pin_hook=pin_hook)
        # Unpinned before its memory goes, also when the optimizer is dropped without close().
        weakref.finalize(self, self.pool.close)
        state.ledger.add("cpu", "optimizer_swap_buffers", self.pool.total_bytes)
        store: ShardStore = state.optimizer_store
        self.units = {u.key: u for u in state.units}
        self.numels: dict[str, int] = {}
        for k in keys:
            unit = self.units[k]
            self.numels[k] = unit.layout.shard_numel
            for name in ("exp_avg", "exp_avg_sq"):
                store.create(f"{name}:{k}", unit.layout.shard_numel, torch.float32)  # zeros, like torch's lazy init
        self.param_groups = [{"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}]
        self.steps = {k: torch.tensor(0.0) for k in keys}
        """Per-unit step count (torch keeps one per parameter; a unit is stepped as one)."""
        self._prefetched: dict[_Chunk, tuple[AlignedBuffer, list[Pending]]] = {}
        """Chunks of the next step whose master and Adam states are read ahead (see the Note)."""
        self._prefetch_stamp: tuple[int, ...] = ()
        # The chunks read ahead during backward, where every state store is one to read ahead from.
        streamed = all(isinstance(s, NvmeStore) for s in self._state_stores())
        self._ahead = self._chunks(keys)[: self.pool.num_buffers - 1] if streamed and not in_backward else []
        if self._ahead:  # called on every unit's backward: only when there is something to read
            state.after_unit_backward.append(self._prefetch_one)
        # In-backward update ([Note: the optimizer step in backward]).
        self._order: list[str] = list(reversed(keys))
        """Units in the order the last step updated them (the guess before any step: reversed)."""
        self._updated: list[str] = []
        """Units updated in this backward, in order."""
        self._expected: list[_Chunk] = []
        self._next_expected = 0
        self._diverged = False
        self._read_ahead: deque[tuple[_Chunk, AlignedBuffer, list[Pending]]] = deque()
        self._writes: deque[tuple[AlignedBuffer, list[Pending]]] = deque()
        self._reading_ahead_since: tuple[int, ...] | None = None
        """The stores' write stamp when this step's read-ahead started (None: not started)."""
        if in_backward:
            state.at_forward_tail.append(self._start_read_ahead)
            state.at_backward_begin.append(self._begin_backward)

    def step(self, live_keys: list[str]) -> None:
        for k in live_keys:
            self.units[k].settle_grads()
        chunks = self._chunks(live_keys)
        if self._prefetched and (self._write_stamp() != self._prefetch_stamp
                                 or not set(self._prefetched) <= set(chunks)):
            self._drop_prefetched()  # the stores were written since (or the unit got no gradient)
        stepped: set[str] = set()
        writes: deque[tuple[AlignedBuffer, list[Pending]]] = deque()
        reads: deque[tuple[AlignedBuffer, list[Pending]]] = deque()
        next_read = 0
        try:
            # Read ahead as far as the pool allows: with B buffers, chunks i+1 .. i+B-2 are read while
            # chunk i is updated and the writes of earlier chunks drain (a buffer is freed by retiring
            # the oldest write). Three buffers give read k+1 | update k | write k-1.
            read_ahead = max(1, self.pool.num_buffers - 2) if self.pool.num_buffers > 1 else 0
            for i, chunk in enumerate(chunks):
                while next_read < len(chunks) and next_read <= i + read_ahead:
                    if not self.pool.num_free and writes:
                        self._retire(writes.popleft())
                    ahead = chunks[next_read]
                    if ahead in self._prefetched:
                        buffer, pendings = self._prefetched.pop(ahead)
                        reads.append((buffer, [*pendings, self._read_grad(ahead, buffer)]))
                    else:
                        buffer = self.pool.acquire()
                        reads.append((buffer, self._read(ahead, buffer)))
                    next_read += 1
                buffer, pendings = reads.popleft()
                for p in pendings:
                    p.wait()
                if chunk.key not in stepped:
                    self.steps[chunk.key] += 1
                    stepped.add(chunk.key)
                master, exp_avg, exp_avg_sq, grad = self._views(buffer, chunk.numel)
                self._adamw(chunk.key, master, grad, exp_avg, exp_avg_sq)
                writes.append((buffer, self._write(chunk, buffer)))
        finally:
            while writes:
                self._retire(writes.popleft())
            while reads:
                self._retire(reads.popleft())
            self._drop_prefetched()  # only left over when the step failed
            # Let the writes land. The gradients' write staging stays for the next backward (the
            # bill's gradient_swap_buffers); that of the compute copies of the parameters (mixed
            # precision) is given back, since the forward's reads need the room.
            assert self.state.grad_store is not None
            self.state.grad_store.drain(keep_staging=True)
            self.state.param_store.drain()

    # -- in backward ([Note: the optimizer step in backward]) ----------------------------------
    def update_unit(self, key: str, gradient: UnitGradient) -> None:
        """Update unit `key` now, with its final gradient of this backward."""
        self.steps[key] += 1
        self._updated.append(key)
        for chunk in self._chunks([key]):
            buffer, pendings = self._claim(chunk)
            for p in pendings:
                p.wait()
            master, exp_avg, exp_avg_sq, grad_region = self._views(buffer, chunk.numel)
            grad = gradient.chunk(chunk.start, chunk.numel, grad_region)
            if gradient.device.type != "cpu":  # copied off the GPU into the chunk buffer
                links = self.state.profiler.link_bytes
                links["d2h"] = links.get("d2h", 0) + chunk.numel * gradient.element_size
            self._adamw(key, master, grad, exp_avg, exp_avg_sq)
            self._writes.append((buffer, self._write(chunk, buffer)))
            self._read_more()

    def finish_in_backward(self) -> None:
        """At `optimizer.step()`: let the updates' writes land; what was read ahead for units that got
        no gradient is dropped; the order of this step's updates is the next step's guess."""
        try:
            self._drop_read_ahead()
            while self._writes:
                self._retire(self._writes.popleft())
        finally:
            if self._updated:
                self._order = self._updated
            self._updated = []
            self._reading_ahead_since = None
            self.state.param_store.drain()

    def _begin_backward(self) -> None:
        if self._reading_ahead_since != self._write_stamp():  # not started, or the stores were written since
            self._start_read_ahead()

    def _start_read_ahead(self) -> None:
        self._drop_read_ahead()  # left over only when the last backward failed
        self._reading_ahead_since = self._write_stamp()
        self._updated = []
        self._expected = self._chunks(self._order)
        self._next_expected = 0
        self._diverged = False
        self._read_more()

    def _claim(self, chunk: _Chunk) -> tuple[AlignedBuffer, list[Pending]]:
        """The buffer `chunk`'s states are (being) read into: read ahead, or read now."""
        if self._read_ahead and self._read_ahead[0][0] == chunk:
            _, buffer, pendings = self._read_ahead.popleft()
            return buffer, pendings
        expected = (not self._diverged and not self._read_ahead and self._next_expected < len(self._expected)
                    and self._expected[self._next_expected] == chunk)
        if expected:  # next in order, not read ahead for want of a free buffer
            self._next_expected += 1
        else:  # the order changed: read on demand from here on (re-recorded at the step)
            self._diverged = True
            self._drop_read_ahead()
        if not self.pool.num_free and self._writes:
            self._retire(self._writes.popleft())
        buffer = self.pool.acquire()
        return buffer, self._read_states(chunk, buffer)

    def _read_more(self) -> None:
        """Read the next expected chunks' states into buffers that are free or whose writes landed,
        without waiting for any."""
        while not self._diverged and self._next_expected < len(self._expected):
            if not self.pool.num_free:
                if not self._writes or not all(p.ready() for p in self._writes[0][1]):
                    return
                self._retire(self._writes.popleft())
            chunk = self._expected[self._next_expected]
            self._next_expected += 1
            buffer = self.pool.acquire()
            self._read_ahead.append((chunk, buffer, self._read_states(chunk, buffer)))

    def _drop_read_ahead(self) -> None:
        while self._read_ahead:
            _, buffer, pendings = self._read_ahead.popleft()
            self._retire((buffer, pendings))

    def close(self) -> None:
        if self._prefetch_one in self.state.after_unit_backward:
            self.state.after_unit_backward.remove(self._prefetch_one)
        if self._begin_backward in self.state.at_backward_begin:
            self.state.at_backward_begin.remove(self._begin_backward)
        if self._start_read_ahead in self.state.at_forward_tail:
            self.state.at_forward_tail.remove(self._start_read_ahead)
        self._drop_read_ahead()
        while self._writes:
            self._retire(self._writes.popleft())
        self._drop_prefetched()
        self.state.ledger.sub("cpu", "optimizer_swap_buffers", self.pool.total_bytes)
        self.pool.close()

    # -- internals --------------------------------------------------------------------------
    def _chunks(self, keys: list[str]) -> list[_Chunk]:
        return [_Chunk(k, s, min(self.chunk_numel, self.numels[k] - s))
                for k in keys for s in range(0, self.numels[k], self.chunk_numel)]

    def _state_stores(self) -> list[ShardStore]:
        stores = {id(s): s for s in [self.state.optimizer_store, *(s for s, _ in self.state.master_at.values())]}
        return list(stores.values())

    def _write_stamp(self) -> tuple[int, ...]:
        return tuple(s.num_writes for s in self._state_stores() if isinstance(s, NvmeStore))

    def _prefetch_one(self) -> None:
        """Read the master and Adam states of the next of the step's first chunks not read yet (see
        [Note: reading the next step's states ahead])."""
        if len(self._prefetched) >= len(self._ahead):
            return
        if not self._prefetched:
            self._prefetch_stamp = self._write_stamp()
        chunk = self._ahead[len(self._prefetched)]
        buffer = self.pool.acquire()
        self._prefetched[chunk] = (buffer, self._read_states(chunk, buffer))

    def _drop_prefetched(self) -> None:
        prefetched, self._prefetched = self._prefetched, {}
        for entry in prefetched.values():
            self._retire(entry)

    def _adamw(self, key: str, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor) -> None:
        group = self.param_groups[0]
        torch._fused_adamw_([master], [grad], [exp_avg], [exp_avg_sq], [], [self.steps[key]],
                            amsgrad=False, lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    def _views(self, buffer: AlignedBuffer, numel: int) -> list[torch.Tensor]:
        flat = torch.frombuffer(buffer.view, dtype=torch.float32)
        n = self.chunk_numel
        return [flat[r * n : r * n + numel] for r in range(REGIONS)]

    def _read(self, chunk: _Chunk, buffer: AlignedBuffer) -> list[Pending]:
        return [*self._read_states(chunk, buffer), self._read_grad(chunk, buffer)]

    def _read_states(self, chunk: _Chunk, buffer: AlignedBuffer) -> list[Pending]:
        """The fp32 master and the Adam states of `chunk` (everything but its gradient)."""
        st = self.state
        master, exp_avg, exp_avg_sq, _ = self._views(buffer, chunk.numel)
        master_store, master_key = st.master_at[chunk.key]
        opt = st.optimizer_store
        return [master_store.read_into(master_key, master, chunk.start),
                opt.read_into(f"exp_avg:{chunk.key}", exp_avg, chunk.start),
                opt.read_into(f"exp_avg_sq:{chunk.key}", exp_avg_sq, chunk.start)]

    def _read_grad(self, chunk: _Chunk, buffer: AlignedBuffer) -> Pending:
        grad = self._views(buffer, chunk.numel)[3]
        assert self.state.grad_store is not None, "gradients are not stored: the update runs in backward"
        return self.state.grad_store.read_into(chunk.key, grad, chunk.start)

    def _write(self, chunk: _Chunk, buffer: AlignedBuffer) -> list[Pending]:
        st = self.state
        master, exp_avg, exp_avg_sq, _ = self._views(buffer, chunk.numel)
        master_store, master_key = st.master_at[chunk.key]
        opt = st.optimizer_store
        out = [master_store.write_from(master_key, master, chunk.start),
               opt.write_from(f"exp_avg:{chunk.key}", exp_avg, chunk.start),
               opt.write_from(f"exp_avg_sq:{chunk.key}", exp_avg_sq, chunk.start)]
        if master_key != chunk.key:  # a separate compute copy of the parameters (mixed precision)
            out.append(st.param_store.write(chunk.key, master.to(st.config.compute_dtype), chunk.start))
        return out

    def _retire(self, entry: tuple[AlignedBuffer, list[Pending]]) -> None:
        buffer, pendings = entry
        for p in pendings:
            p.wait()
        self.pool.release(buffer)
