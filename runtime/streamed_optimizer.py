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
previous step: there the reads competed with the forward's parameter reads, and on the io-bound
benchmark (benchmarks/bench_nvme_step.py, 2 vCPUs, virtio disk) forward went from 0.159 to 0.116 s
and backward from 0.203 to 0.240 s, the step from 0.831 to 0.813 s median (8 paired blocks of 3
steps, 0.964 median of paired ratios). The states only change in a step, so the copies stay
exact unless something else writes the stores in between (loading a checkpoint): the stores count
their writes, and a step whose stores were written since the prefetch drops it and reads afresh.
Chunks prefetched for units that got no gradient this step are dropped too.

The arithmetic is the same kernel `torch.optim.AdamW(fused=True)` runs over the whole shard
(elementwise, so chunking does not change a bit; `tests/test_nvme_training.py` checks it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from runtime.nvme import AlignedBuffer, BufferPool
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
                 weight_decay: float) -> None:
        self.state = state
        self.keys = keys
        plan = state.plan
        self.chunk_numel = chunk_numel_for(plan.optimizer_chunk_bytes)
        self.pool = BufferPool(buffer_bytes=REGIONS * 4 * self.chunk_numel, num_buffers=plan.num_optimizer_buffers)
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
        self._ahead = self._chunks(keys)[: self.pool.num_buffers - 1] if streamed else []
        if self._ahead:  # called on every unit's backward: only when there is something to read
            state.after_unit_backward.append(self._prefetch_one)

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
                group = self.param_groups[0]
                torch._fused_adamw_([master], [grad], [exp_avg], [exp_avg_sq], [], [self.steps[chunk.key]],
                                    amsgrad=False, lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                                    weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
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
            self.state.grad_store.drain(keep_staging=True)
            self.state.param_store.drain()

    def close(self) -> None:
        if self._prefetch_one in self.state.after_unit_backward:
            self.state.after_unit_backward.remove(self._prefetch_one)
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
