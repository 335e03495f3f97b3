"""What a host shard's crossing to and from a GPU costs beyond the link: the plan's `host_pinning`.

[Note: staged and pinned host copies]
The runtime moves host-memory state across a GPU's host link in one of two ways (the plan's
`host_pinning`, runtime/transfer/crossings.py):
- `shards`: the compute-precision parameter shards and the recompute inputs live in pinned memory
  and are copied straight from and into, at the link's rate (`host_to_gpu_bytes_per_s`,
  `gpu_to_host_bytes_per_s`, which `planner probe` measures with pinned buffers);
- `staged`: they stay pageable, and every copy to the device first goes through the pinned staging
  pool: the launching thread memcpys each piece into a pool buffer, then the link copies it on.
  With a few buffers the two overlap, so a staged copy runs at the slower of the link and one
  thread's memcpy (`staged_h2d_bytes_per_s`); the memcpy is the thread's, not the node's, so it
  does not grow with the GPUs.
Both ways, a gradient shard copied off the device into host memory is added into its fp32 shard by
the rank's transfer worker (one thread: runtime/transfer/host_worker.py) as it lands, reading the
16-bit gradient and the fp32 shard and writing the shard back, at the same thread's streaming rate
(`landing_bytes_per_s`); the worker overlaps the link's next copy, so the landing runs at the
slower of the two. The fp32 masters written back to device parameters go through the pool either
way. A thread's memcpy rate is the probe's `host_memcpy_gb_per_s`; where a spec does not state
it, the GPU's share of the node's host-memory bandwidth stands in (a copy reads and writes each byte).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from planner.cost.memory import MemoryBill, host_state_crosses_link, memory_bill
from planner.specs.memory_terms import MemoryTerm
from planner.specs.plan import HostPinning
from planner.specs.tiers import HOST
from planner.specs.units import COMPUTE_BYTES, GIB

if TYPE_CHECKING:
    from planner.specs.hardware import NodeSpec
    from planner.specs.plan import Plan

FP32_SHARD_BYTES = 4
"""The fp32 gradient shard a landing gradient is added into: read and written."""


def host_memcpy_bytes_per_s(node: NodeSpec) -> float:
    """One host thread's pageable-to-pinned memcpy rate ([Note: staged and pinned host copies])."""
    if node.host_memcpy_bytes_per_s > 0:
        return node.host_memcpy_bytes_per_s
    return node.host_memory_bytes_per_s / node.num_gpus_per_node / 2


def stages_host_shards(plan: Plan) -> bool:
    """Whether the plan's host shards cross to its GPUs through the staging pool (`host_pinning:
    staged` on hardware whose host is not the device)."""
    return plan.host_pinning is HostPinning.STAGED and not plan.node.host_is_device


def staged_h2d_bytes_per_s(plan: Plan, link_bytes_per_s: float) -> float:
    """A staged host-to-device copy's rate: the slower of the link and one thread's memcpy."""
    return min(link_bytes_per_s, host_memcpy_bytes_per_s(plan.node))


def landing_bytes_per_s(plan: Plan) -> float:
    """Gradient bytes per second the transfer worker adds into fp32 host shards as they land: per
    element it reads the gradient and the fp32 shard and writes the shard, where a memcpy reads and
    writes one element of the gradient's width."""
    element = COMPUTE_BYTES[plan.precision]
    return host_memcpy_bytes_per_s(plan.node) * 2 * element / (element + 2 * FP32_SHARD_BYTES)


def landing_host_bytes_per_byte(plan: Plan) -> float:
    """Host memory bytes read and written per gradient byte that lands in an fp32 host shard: the
    DMA writes the 16-bit gradient into a pinned buffer (`e`), the worker reads it (`e`) and the fp32
    shard (4) and writes the shard (4). A memcpy counts each byte read and written, as the probe's
    host-memory rate does. That rate over these 6 bytes per bf16 gradient byte is what the GPU kit's
    staged stage times for the landing add alone (the measurement: docs/notes/2026-11-28-offload-prediction-h200.md)."""
    element = COMPUTE_BYTES[plan.precision]
    return (2 * element + 2 * FP32_SHARD_BYTES) / element


PINNED_HOST_TERMS = (MemoryTerm.PINNED_STAGING_POOL, MemoryTerm.GRADIENT_LANDING_BUFFERS,
                     MemoryTerm.PARAM_SWAP_BUFFERS, MemoryTerm.GRADIENT_SWAP_BUFFERS, MemoryTerm.OPTIMIZER_SWAP_BUFFERS)
"""The host buffers the runtime page-locks on hardware whose host is not the device, whatever the pinning."""
PINNED_SHARD_TERMS = (MemoryTerm.PARAMS, MemoryTerm.RECOMPUTE_INPUTS)
"""Host-memory terms the runtime page-locks with `host_pinning: shards` ([Note: pinned host shards] in
runtime/transfer/pinned_arena.py)."""


def pinned_host_bytes(plan: Plan, bill: MemoryBill | None = None) -> int:
    """Page-locked host bytes one rank (one process) holds: what its locked-memory limit must allow
    (from `bill`, the plan's own bill, where the caller has it)."""
    if plan.node.host_is_device:
        return 0
    host = (bill or memory_bill(plan)).terms[HOST]
    terms = PINNED_HOST_TERMS + (PINNED_SHARD_TERMS if plan.host_pinning is HostPinning.SHARDS else ())
    return math.ceil(sum(host.get(term, 0) for term in terms) / plan.cluster.gpus_per_node)


def choose_host_pinning(plan: Plan, locked_memory_bytes: float) -> tuple[Plan, str]:
    """`plan` with `host_pinning: shards` where its host shards cross a link and pinning them fits:
    the bill with them pinned fits host memory and a rank's pinned bytes fit `locked_memory_bytes`
    (RLIMIT_MEMLOCK); else `staged`, and one line saying why when the limit or host memory forbade it."""
    chosen, line, _ = choose_host_pinning_billed(plan, locked_memory_bytes)
    return chosen, line


def choose_host_pinning_billed(plan: Plan, locked_memory_bytes: float,
                               staged_bill: MemoryBill | None = None) -> tuple[Plan, str, MemoryBill | None]:
    """`choose_host_pinning`, with the chosen plan's bill where it was made (the search prices the
    plan from it): `staged_bill` is the bill of `plan` with `host_pinning: staged`, if the caller has it."""
    if plan.host_pinning is HostPinning.STAGED:
        staged = plan
    else:
        staged, staged_bill = plan.replace(host_pinning=HostPinning.STAGED), None
    pinned = plan.replace(host_pinning=HostPinning.SHARDS)
    if plan.node.host_is_device or not host_state_crosses_link(staged):
        return staged, "", staged_bill
    bill = memory_bill(pinned)
    need = pinned_host_bytes(pinned, bill)
    if need > locked_memory_bytes:
        return staged, (f"host_pinning: staged: pinning the host shards takes {need / GIB:,.2f} GiB of locked memory per "
                        f"process, over the limit of {locked_memory_bytes / GIB:,.2f} GiB (ulimit -l); raise it "
                        "(ulimit -l unlimited, or memlock in /etc/security/limits.conf) to pin them"), staged_bill
    if not bill.fits:
        return staged, f"host_pinning: staged: with the host shards pinned the plan does not fit ({bill.reason()})", staged_bill
    return pinned, "", bill
