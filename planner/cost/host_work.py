"""The streamed optimizer step's host work besides Adam: the copies its worker makes on the CPU.

[Note: the step's host copies] With the optimizer states on NVMe the runtime's step
(runtime/optim/streamed_optimizer.py, `StreamedAdamW`) updates each chunk in an aligned buffer that the
drive fills and drains directly, but three of its operands pass through the CPU on the way:
- the fp32 gradient, where it lives in host memory (`HostStore.read_into` copies it into the
  chunk buffer: 4 bytes read, 4 written per parameter); from NVMe the drive writes it in place;
- the 16-bit compute copy of the parameters, where they are kept apart from the fp32 master
  (mixed precision, or parameters in another tier than the states): `master.to(compute_dtype)`
  reads 4 bytes and writes `e` per parameter;
- that copy's way to its store: `NvmeStore.write` stages it for the drive, and a host-memory
  store copies it into its shard (`e` read, `e` written either way); a CUDA device's copy is the
  host-to-device link's, priced there.
With the optimizer states in host memory (runtime/optim/resident_optimizer.py, `ResidentAdamW`)
fused AdamW updates the fp32 master in place, and where the parameters are a separate copy in host
memory (mixed precision, or another host tier) `_write_back` casts the updated master into that
copy's shard (`HostStore.write_host`: 4 bytes read, `e` written per parameter); a copy on a GPU
crosses through the staging pool (the host-to-device link's, priced there).
They are memory-bound passes on the optimizer worker's thread, between its updates, so the
simulator and the estimate time them with Adam on the CPU optimizer's resource, at the host's
memory bandwidth: what CPU Adam's probed rate (fused AdamW over tensors already in place) leaves
out. Where the CPU is the compute device and has few cores they can be most of the worker's busy
time in a step (measurements: docs/notes/2026-11-26-calibration-loop-quiet-machine.md and, for the
resident step's cast on an H200 host, docs/notes/2026-11-28-offload-prediction-h200.md). The
resident (host-memory) step's cast: [Note: the resident step's cast] below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.specs.plan import master_is_param_shard
from planner.specs.units import COMPUTE_BYTES

if TYPE_CHECKING:
    from planner.specs.plan import Plan

GRADIENT_COPY_BYTES = 8
"""The fp32 gradient copied from host memory into the chunk buffer: 4 bytes read, 4 written."""
MASTER_BYTES = 4


def step_host_copy_bytes_per_param(plan: Plan) -> float:
    """Host memory bytes the CPU step's copies move per parameter ([Note: the step's host copies]);
    0 where the optimizer steps on a GPU."""
    place, node = plan.placement, plan.node
    states, params = place.optimizer_states, place.params
    if not states.staged and not states.in_host_memory(node):
        return 0.0
    e = COMPUTE_BYTES[plan.precision]
    nbytes = 0.0
    if states.staged and place.gradients.in_host_memory(node):
        nbytes += GRADIENT_COPY_BYTES
    if master_is_param_shard(plan):
        return nbytes  # the master is the parameter shard: nothing to cast or copy
    if states.staged:
        nbytes += MASTER_BYTES + e  # the cast to the compute precision
        if not params.on_device or node.host_is_device:
            nbytes += 2 * e  # staged for the drive, or copied into a host-memory shard
    elif params.in_host_memory(node):
        nbytes += resident_cast_bytes_per_param(plan)  # resident states: the cast into the host shard
    elif params.staged:
        nbytes += MASTER_BYTES + 3 * e  # resident states, parameters on NVMe: cast, then staged for the drive
    return nbytes


# [Note: the resident step's cast] With the optimizer states in host memory (not streamed) the update
# is in place in the fp32 master, but a mixed-precision plan whose parameters are in host memory too
# keeps a 16-bit parameter shard of its own (`host_param_shard: compute_copy`): each update casts the
# master into it on the same thread (`HostStore.write_host`: 4 bytes read, `e` written per
# parameter), priced like the streamed step's copies. With `host_param_shard: master` the shard is the
# master and nothing is cast on the host; the device casts what it reads instead
# (`host_param_read_bytes`: the link moves 4 bytes per parameter, not `e`).
def resident_cast_bytes_per_param(plan: Plan) -> float:
    """Host memory bytes per parameter the resident (host-memory) step's cast of the updated master
    into the 16-bit parameter shard moves ([Note: the resident step's cast]); 0 where there is no
    such shard (the master is the parameter shard, or the parameters or states are elsewhere)."""
    place, node = plan.placement, plan.node
    if (master_is_param_shard(plan) or place.optimizer_states.staged
            or not place.optimizer_states.in_host_memory(node) or not place.params.in_host_memory(node)):
        return 0.0
    return MASTER_BYTES + COMPUTE_BYTES[plan.precision]


def host_param_read_bytes(plan: Plan) -> int:
    """Bytes per element of the parameter shard as it is read off its tier: the fp32 master where it
    is the shard of a mixed-precision plan ([Note: the resident step's cast]), else the compute precision."""
    return 4 if master_is_param_shard(plan) else COMPUTE_BYTES[plan.precision]


def step_cpu_params_per_param(plan: Plan) -> float:
    """One parameter updated by the CPU step, in parameters of CPU Adam's rate: Adam's own work
    plus its host copies at the host's memory bandwidth, as one busy time of the CPU optimizer
    ([Note: the step's host copies], [Note: the resident step's cast]); 1 without copies."""
    node = plan.node
    copies = step_host_copy_bytes_per_param(plan)
    if not copies or node.host_memory_bytes_per_s <= 0:
        return 1.0
    return 1 + copies * node.cpu_adam_params_per_s / node.host_memory_bytes_per_s
