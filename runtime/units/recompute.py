"""Recompute: segments of `recompute_interval` blocks whose forward runs again in backward, each
keeping only its input (its recompute input, optionally offloaded). (Training checkpoints, the files
a run resumes from, are runtime/ckpt.)

The blocks of the model (the elements of its largest `nn.ModuleList`) are grouped into segments of
`ci` consecutive blocks. Each block is wrapped, in place in its list, by a `RecomputedBlock`;
the model's own loop calls them unchanged. Only the segment's input is kept (eq. 3);
everything inside is recomputed in backward (working memory eq. 5).

[Note: segment recompute without owning the loop]
The model calls the blocks one by one, so no single call spans a segment. We therefore drive torch's
non-reentrant recompute frame (`torch.utils.checkpoint`, torch's name for it) by hand: the first
block of a segment opens it, the last one closes it, and every tensor autograd saves in between is
replaced by a recompute handle. The recompute
function replays the segment from the stored input, calling each block with the extra arguments it
received in forward (masks, rotary embeddings, ...) and the previous block's first output as its
hidden state. The frame's only tensor argument is an empty device marker; the real input lives in
our recompute-input store, so offloading it needs no cooperation from torch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import _checkpoint_without_reentrant_generator, noop_context_fn

from planner.specs.memory_terms import MemoryTerm
from planner.specs.plan import HostPinning
from planner.specs.tiers import Tier
from runtime.ledger import MemoryLedger, nbytes
from runtime.nvme.buffers import AlignedBuffer
from runtime.transfer.stores import CopyEngine
from runtime.transfer.streams import DeviceEvent
from runtime.transfer.trace import Role, hook


class RecomputeInputStore:
    """Holds segment inputs on the compute device (`gpu` placement)."""

    tier = "gpu"

    def __init__(self, ledger: MemoryLedger, copier: CopyEngine) -> None:
        self.ledger = ledger
        self.copier = copier

    def save(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        self.ledger.add(self.tier, MemoryTerm.RECOMPUTE_INPUTS, nbytes(x))
        return x.detach(), None

    def prefetch(self, held: torch.Tensor, event: Any) -> Any:  # noqa: ARG002
        """Start bringing a held input back to the compute device (nothing to do here)."""
        return event

    def load(self, held: torch.Tensor, event: Any) -> torch.Tensor:  # noqa: ARG002
        return held

    def drop(self, held: torch.Tensor) -> None:
        self.ledger.sub(self.tier, MemoryTerm.RECOMPUTE_INPUTS, nbytes(held))

    def close(self) -> None:  # noqa: B027 - a no-op unless overridden
        """Give back what the store keeps between steps."""


class HostRecomputeInputStore(RecomputeInputStore):
    """Holds segment inputs in pageable host memory (`cpu` placement), copied through the rank's
    pinned staging pool on the side stream on CUDA. On a CPU-only machine the input already is in
    host memory and is held as it is.

    [Note: asynchronous recompute-input offload]
    On CUDA both directions run on the copy stream through the staging pool ([Note: staged host
    copies] in runtime/transfer/pinned_pool.py): `save` queues the input's device-to-host copy and returns;
    each piece lands in the held host tensor once its copy is done (at a later lease of the pool at
    the latest). `prefetch` (one segment ahead of the recompute, see `RecomputeSegment._replay`)
    queues the host-to-device copy into a tensor allocated on the copy stream: a piece that has
    not landed yet goes from its pinned buffer, after its device-to-host copy on the same stream,
    so the host waits for neither; `load` makes the compute stream wait on that copy's event."""

    tier = "cpu"

    def save(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if not self.copier.separate_memory:
            return super().save(x)
        host = torch.empty(x.shape, dtype=x.dtype)
        flat = host.view(-1)
        transfer = self.copier.to_host(x.detach().reshape(-1),
                                       lambda piece, at: flat[at : at + piece.numel()].copy_(piece))
        self.ledger.add(self.tier, MemoryTerm.RECOMPUTE_INPUTS, nbytes(host))
        return host, transfer

    def prefetch(self, held: torch.Tensor, event: Any) -> Any:
        """Start bringing a held input back to the device; `load` takes what this returns."""
        if not self.copier.separate_memory or isinstance(event, tuple):  # here, or on its way
            return event
        return self.copier.back_to_device(held, event)

    def load(self, held: torch.Tensor, event: Any) -> torch.Tensor:
        if not self.copier.separate_memory:
            return held
        staged, copy_done = event if isinstance(event, tuple) else self.prefetch(held, event)
        if copy_done is not None:  # the copy runs on the copy stream
            streams = self.copier.streams
            streams.wait(Role.COMPUTE, copy_done)
            streams.keep(staged, Role.COMPUTE)  # allocated on the copy stream
        return staged


class _PinnedHold(NamedTuple):
    buffer: AlignedBuffer
    read: list[DeviceEvent | None]
    """The last copy back to the device out of it (one element, replaced), which a new save follows."""


class PinnedRecomputeInputStore(HostRecomputeInputStore):
    """Segment inputs in pinned host memory (`cpu` placement, `host_pinning: shards`, a device of its
    own): each goes off the device straight into a pinned buffer on the device-to-host stream after
    the event of the work that produced it, and comes back from it on the host-to-device stream
    after that copy; the host waits for neither. The buffers are kept from step to step, pinned in
    the first and charged to the ledger until the store is closed ([Note: pinned host shards] in
    runtime/transfer/pinned_arena.py)."""

    def __init__(self, ledger: MemoryLedger, copier: CopyEngine) -> None:
        super().__init__(ledger, copier)
        self._free: list[_PinnedHold] = []
        self._out: dict[int, _PinnedHold] = {}
        """Host address -> the hold of each input saved and not dropped."""
        self._all: list[_PinnedHold] = []

    def save(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        size = nbytes(x)
        fitting = [h for h in self._free if h.buffer.capacity_bytes >= size]
        if fitting:
            hold = min(fitting, key=lambda h: h.buffer.capacity_bytes)
            self._free.remove(hold)
        else:
            buffer = self.copier.streams.pinned_buffer(size, MemoryTerm.RECOMPUTE_INPUTS)
            self.ledger.add(self.tier, MemoryTerm.RECOMPUTE_INPUTS, buffer.capacity_bytes)
            hold = _PinnedHold(buffer, [None])
            self._all.append(hold)
        host = torch.frombuffer(hold.buffer.view, dtype=x.dtype, count=x.numel()).view(x.shape)
        self._out[host.data_ptr()] = hold
        self.copier.streams.wait(Role.D2H, hold.read[0])  # the last step's copy back out of it is over
        return host, self.copier.from_device(host.view(-1), x.detach().reshape(-1))

    def prefetch(self, held: torch.Tensor, event: Any) -> Any:
        if isinstance(event, tuple):  # on its way back already
            return event
        staged, copied = self.copier.to_device(held, after=event)
        self._out[held.data_ptr()].read[0] = copied
        return staged, copied

    def drop(self, held: torch.Tensor) -> None:
        self._free.append(self._out.pop(held.data_ptr()))

    def close(self) -> None:
        holds, self._all, self._free = self._all, [], []
        for hold in holds:
            self.ledger.sub(self.tier, MemoryTerm.RECOMPUTE_INPUTS, hold.buffer.capacity_bytes)
            hook = self.copier.streams.pin_hook(MemoryTerm.RECOMPUTE_INPUTS)
            if hook is not None:
                hook.unpin(hold.buffer.address)


RECOMPUTE_INPUT_STORES: dict[str, type[RecomputeInputStore]] = {
    "gpu": RecomputeInputStore, "cpu": HostRecomputeInputStore}
"""Placement tier of `recompute_inputs` -> where segment inputs are held (`host_pinning: shards`
on a device of its own holds the `cpu` ones in pinned memory: `recompute_input_store_for`)."""


def recompute_input_store_for(tier: Tier, pinning: HostPinning, ledger: MemoryLedger,
                              copier: CopyEngine) -> RecomputeInputStore:
    """Where segment inputs placed in `tier` are held."""
    if tier.host_memory and pinning is HostPinning.SHARDS and copier.separate_memory:
        return PinnedRecomputeInputStore(ledger, copier)
    return RECOMPUTE_INPUT_STORES[tier](ledger, copier)


class RecomputeSegment:
    """`ci` consecutive blocks sharing one recompute input; state of the current forward pass."""

    def __init__(self, blocks: list[nn.Module], store: RecomputeInputStore) -> None:
        self.blocks = blocks
        self.store = store
        self.recomputing = False
        self._frame = None  # torch's open frame (a generator) between the first and last block
        self._input: tuple[torch.Tensor, Any] | None = None
        self._input_requires_grad = False
        self._calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        """Each block's arguments other than the hidden state, for the replay."""
        self.recomputed_next: RecomputeSegment | None = None
        """The segment whose recompute follows this one's in backward (the one before it in the
        forward): its input is prefetched when this recompute starts."""

    def prefetch_input(self) -> None:
        """Start bringing the input back for the recompute ([Note: asynchronous recompute-input offload])."""
        if self._input is not None:
            held, event = self._input
            self._input = (held, self.store.prefetch(held, event))

    def begin(self, x: torch.Tensor) -> None:
        self.release()
        self._input = self.store.save(x)
        self._input_requires_grad = x.requires_grad
        self._calls = []
        marker = torch.empty(0, device=x.device)
        self._frame = _checkpoint_without_reentrant_generator(
            self._replay, True, noop_context_fn, "default", False, True, marker
        )
        next(self._frame)

    @property
    def awaits_recompute(self) -> bool:
        """Its input is saved and its recompute has not run yet."""
        return self._input is not None

    def record(self, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._calls.append((rest, kwargs))

    def end(self) -> None:
        frame, self._frame = self._frame, None
        assert frame is not None, "a segment closed that was never opened"
        try:
            next(frame)
        except StopIteration:
            return
        raise AssertionError("torch's recompute frame did not finish")

    @hook("recompute")
    def _replay(self, marker: torch.Tensor) -> None:  # noqa: ARG002 - the device marker
        assert self._input is not None, "recompute of a segment whose input was released"
        # Same requires_grad as in forward: kernels (e.g. SDPA's backend) may choose by it, and the
        # recompute must save exactly what the forward saved.
        x = self.store.load(*self._input).detach().requires_grad_(self._input_requires_grad)
        if self.recomputed_next is not None:  # one segment of prefetch
            self.recomputed_next.prefetch_input()
        calls = self._calls
        self.recomputing = True
        try:
            for block, (rest, kwargs) in zip(self.blocks, calls, strict=True):
                out = block(x, *rest, **kwargs)
                x = out[0] if isinstance(out, tuple | list) else out
        finally:
            self.recomputing = False
            self.release()  # the frame now holds everything backward needs

    def release(self) -> None:
        """Drop the input (after its recompute, or at the end of the step)."""
        if self._input is not None:
            self.store.drop(self._input[0])
            self._input = None
        self._calls = []


class RecomputedBlock(nn.Module):
    """A block wrapped in place: opens/closes its segment's recompute frame around the call."""

    def __init__(self, block: nn.Module, segment: RecomputeSegment, position: int) -> None:
        super().__init__()
        self.block = block
        self._segment = segment
        self._position = position

    @hook("checkpointed block")
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        seg = self._segment
        if seg.recomputing or not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor):
            return self.block(*args, **kwargs)
        if self._position == 0:
            seg.begin(args[0])
        seg.record(args[1:], kwargs)
        out = self.block(*args, **kwargs)
        if self._position == len(seg.blocks) - 1:
            seg.end()
        return out

    def __getattr__(self, name: str) -> Any:
        # Model code sometimes reads attributes of its blocks (e.g. `layer.attention_type`).
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["block"], name)


def find_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The transformer blocks: the `nn.ModuleList` holding the most parameters."""
    best, best_numel = None, 0
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            numel = sum(p.numel() for p in module.parameters())
            if numel > best_numel:
                best, best_numel = module, numel
    return best


def apply_recompute(
    blocks: nn.ModuleList, interval: int, store: RecomputeInputStore
) -> list[RecomputeSegment]:
    """Wrap `blocks` in place into segments of `interval` blocks."""
    segments = []
    for start in range(0, len(blocks), interval):
        members = [blocks[i] for i in range(start, min(start + interval, len(blocks)))]
        segment = RecomputeSegment(members, store)
        if segments:
            segment.recomputed_next = segments[-1]
        for position, index in enumerate(range(start, start + len(members))):
            blocks[index] = RecomputedBlock(members[position], segment, position)
        segments.append(segment)
    return segments
