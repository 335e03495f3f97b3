"""All-gather and reduce-scatter of flat shards, as free functions returning a waitable result.

[Note: reduce-scatter on gloo]
Older gloo builds have no reduce-scatter; torch 2.13's has one (`native`) but it is the slowest of
three correct implementations, selectable with `shard(..., reduce_scatter_method=...)`:
- `allreduce`: all-reduce the whole flat gradient, keep our slice. Simple, one native collective,
  but each rank moves ~2(n-1)/n of the buffer and receives the slices it then throws away.
- `pairwise` (default): every rank sends slice j to rank j and receives its own slice from every
  other rank (n-1 isend + n-1 irecv, all in flight at once), then sums. Each rank moves (n-1)/n of
  the buffer, like a ring reduce-scatter, without the ring's n-1 dependent steps.
- `native`: the backend's own reduce-scatter (`reduce_scatter_into`: NCCL's, and gloo's when present).
`pairwise` was the fastest on gloo at every buffer size `benchmarks/bench_collectives.py` measured
(benchmarks/RESULTS.md, "gloo reduce-scatter"), so gloo defaults to `pairwise`, NCCL to `native`.

[Note: gloo and device tensors]
NCCL refuses two ranks on one GPU, so ranks that share a GPU (the GPU kit's two-rank runs) reduce
over gloo, and gloo is a host library: its point-to-point `isend`/`irecv` hand the tensor's data
pointer to the TCP transport as host memory, and its reduce-scatter takes host tensors only. On
such a group (`Comm.host_staged`: gloo with a CUDA compute device) every collective therefore runs
on host copies: the caller's device tensor is copied into a host buffer of the collective's own
before it starts (a blocking copy, ordered after the work queued on the current stream), gloo
reduces or gathers host buffers only, and `wait()` copies the result into a device tensor on the
current stream. One extra round trip over the link per collective: a path for correctness on one
shared GPU, not for speed; NCCL groups never take it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from runtime.ledger import nbytes


class Comm(NamedTuple):
    """The process group(s) of one sharded model. Reduce-scatters use their own group so that they
    can be in flight while all-gathers are issued (gloo matches collectives by issue order)."""

    gather_group: dist.ProcessGroup | None
    reduce_group: dist.ProcessGroup | None
    world_size: int
    rank: int
    reduce_scatter_method: str  # "native" | "pairwise" | "allreduce"
    device: torch.device = torch.device("cpu")
    """Where this group's collectives take their tensors: NCCL reduces device tensors only, so on
    NCCL the rank's current CUDA device (bound by runtime.launch.bind_device), else the CPU."""
    host_staged: bool = False
    """gloo with a CUDA compute device: collectives run on host copies of the caller's tensors
    ([Note: gloo and device tensors])."""

    @property
    def device_side(self) -> bool:
        """Collectives are device work the compute stream can wait for (NCCL), not host work (gloo)."""
        return self.device.type == "cuda"

    @staticmethod
    def local() -> Comm:
        return Comm(None, None, 1, 0, "native")


def make_comm(reduce_scatter_method: str | None = None) -> Comm:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return Comm.local()
    backend = dist.get_backend()
    reduce_group = dist.new_group(backend=backend)
    method = reduce_scatter_method or ("pairwise" if backend == "gloo" else "native")
    if method not in ("native", "pairwise", "allreduce"):
        raise ValueError(f"reduce_scatter_method {method!r} must be native, pairwise or allreduce")
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    host_staged = backend == "gloo" and torch.cuda.is_available()
    return Comm(dist.group.WORLD, reduce_group, dist.get_world_size(), dist.get_rank(), method, device, host_staged)


# [Note: flat collectives across torch versions]
# torch 2.13 added `dist.all_gather_single` and `dist.reduce_scatter_single` and deprecated the names
# they replace, `dist.all_gather_into_tensor` and `dist.reduce_scatter_tensor` (each call of an old name
# warns). Every older torch that pyproject.toml admits has only the old names, with the same arguments
# and the same result (torch 2.11 and 2.12). `all_gather_into` and
# `reduce_scatter_into` therefore call the new name where the installed torch has it and the old one
# otherwise; nothing else in the runtime names either. The name is looked up at each call (one
# attribute read beside a collective), so a test can take the new names away from a running process.


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, *, group: dist.ProcessGroup | None = None,
                    async_op: bool = False) -> dist.Work | None:
    """Gather every rank's `shard` into the flat `output` (rank order) with the installed torch's
    collective ([Note: flat collectives across torch versions])."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, shard, group=group, async_op=async_op)


def reduce_scatter_into(output: torch.Tensor, full: torch.Tensor, *, group: dist.ProcessGroup | None = None,
                        async_op: bool = False) -> dist.Work | None:
    """Sum `full` across ranks into this rank's slice `output` with the installed torch's
    collective ([Note: flat collectives across torch versions])."""
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return reduce_scatter(output, full, group=group, async_op=async_op)


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor of the collective's own holding `tensor`'s values (never `tensor` itself, even
    on the CPU): the source of a host-staged collective ([Note: gloo and device tensors])."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    out.copy_(tensor)
    return out


class Gathered(NamedTuple):
    output: torch.Tensor
    work: dist.Work | None
    host: tuple[torch.Tensor, torch.Tensor] | None = None
    """Host-staged: (the shard's host copy, the host buffer gloo gathers into), copied into `output`
    by `wait()` ([Note: gloo and device tensors])."""

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        if self.host is not None:
            self.output.copy_(self.host[1])
        return self.output


def all_gather_flat(comm: Comm, shard: torch.Tensor, link_bytes: dict[str, int]) -> Gathered:
    """Start gathering every rank's shard into one flat buffer (rank order)."""
    if comm.world_size == 1:
        return Gathered(shard, None)
    output = torch.empty(shard.numel() * comm.world_size, dtype=shard.dtype, device=shard.device)
    link_bytes["all_gather"] = link_bytes.get("all_gather", 0) + nbytes(output) - nbytes(shard)
    if comm.host_staged:
        source, gathered = host_copy(shard), torch.empty(output.shape, dtype=output.dtype, device="cpu")
        work = all_gather_into(gathered, source, group=comm.gather_group, async_op=True)
        return Gathered(output, work, (source, gathered))
    work = all_gather_into(output, shard, group=comm.gather_group, async_op=True)
    return Gathered(output, work)


class Reduced(NamedTuple):
    """A reduce-scatter in flight; `wait()` returns this rank's summed (not averaged) slice."""

    works: tuple[dist.Work, ...]
    output: torch.Tensor
    received: tuple[torch.Tensor, ...]
    """Slices from the other ranks (pairwise fallback) still to be added into `output`."""
    landing: torch.Tensor | None = None
    """Host-staged: the device tensor the host sum `output` is copied into by `wait()`
    ([Note: gloo and device tensors])."""

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        for other in self.received:
            self.output.add_(other)
        if self.landing is None:
            return self.output
        self.landing.copy_(self.output)
        return self.landing


def reduce_scatter_flat(comm: Comm, full: torch.Tensor, link_bytes: dict[str, int]) -> Reduced:
    """Start summing `full` (length divisible by the world size) across ranks, scattered by rank."""
    n = comm.world_size
    if n == 1:
        return Reduced((), full, ())
    link_bytes["reduce_scatter"] = link_bytes.get("reduce_scatter", 0) + nbytes(full) * (n - 1) // n
    if comm.host_staged:
        landing = torch.empty(full.numel() // n, dtype=full.dtype, device=full.device)
        return _reduce_scatter(comm, host_copy(full))._replace(landing=landing)
    return _reduce_scatter(comm, full)


def _reduce_scatter(comm: Comm, full: torch.Tensor) -> Reduced:
    """Start `comm.reduce_scatter_method` over `full`, on whatever memory `full` is in."""
    n, rank = comm.world_size, comm.rank
    chunks = full.chunk(n)
    if comm.reduce_scatter_method == "native":
        output = torch.empty_like(chunks[rank])
        work = reduce_scatter_into(output, full, group=comm.reduce_group, async_op=True)
        return Reduced((work,), output, ())
    if comm.reduce_scatter_method == "allreduce":
        work = dist.all_reduce(full, group=comm.reduce_group, async_op=True)
        return Reduced((work,), chunks[rank], ())
    assert comm.reduce_scatter_method == "pairwise", comm.reduce_scatter_method
    works: list[dist.Work] = []
    received: list[torch.Tensor] = []
    for peer in range(n):
        if peer == rank:
            continue
        peer_rank = dist.get_global_rank(comm.reduce_group, peer)
        works.append(dist.isend(chunks[peer].contiguous(), peer_rank, group=comm.reduce_group))
        buf = torch.empty_like(chunks[rank])
        works.append(dist.irecv(buf, peer_rank, group=comm.reduce_group))
        received.append(buf)
    return Reduced(tuple(works), chunks[rank], tuple(received))
