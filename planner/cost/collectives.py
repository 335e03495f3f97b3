"""NCCL's cost of one collective: a latency per ring step plus bytes over the ring's narrowest link.

Every collective is a ring: a base latency, a latency per step of the ring (NVLink, PCIe or the
network) and each rank's received bytes at the ring's bus bandwidth, the narrower of its NVLink
rate and its share of the node's network ([Note: the alpha-beta collective], above the latency
constants, which are NCCL's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from planner.specs.hardware import NodeSpec
from planner.specs.plan import Plan
from planner.specs.stack import ShardCollectives

Collective = Literal["all_gather", "reduce_scatter", "all_reduce"]

# [Note: the alpha-beta collective] NCCL prices a ring collective as (src/graph/tuning.cc, the table
# its tuner picks algorithms with) a base latency, a per-step latency for each of the ring's steps
# (NVLink or PCIe inside a node, the network between nodes) and the bytes each rank receives at the
# ring's bus bandwidth:
#
#     t = base + intra_steps x intra_step + inter_steps x inter_step + received / bus_bandwidth
#
# - steps: a ring all-gather or reduce-scatter over n ranks takes n - 1 steps, an all-reduce
#   2 (n - 1) (reduce-scatter then all-gather); of each pass, `nodes - 1` cross the network
#   (NCCL's nInterSteps); the rest are NVLink hops;
# - received: (n - 1) / n of the tensor per rank for an all-gather or reduce-scatter, twice that
#   for an all-reduce (nccl-tests doc/PERFORMANCE.md: busbw = algbw x (n - 1) / n and
#   algbw x 2 (n - 1) / n, the factors that make bus bandwidth comparable to a link's rate);
# - bus bandwidth, hierarchical: NCCL lays a data-parallel ring out node by node and spreads it over
#   channels, one per NIC (rail), so each ring crosses a node boundary once per pass and the node's
#   NICs share that crossing; inside the node every rank receives its bytes over NVLink. The `mp`
#   tensor-parallel ranks of a node belong to `mp` different data-parallel rings, which share the
#   node's network: per ring, `inter_node / mp`. A rank's time is its bytes over the smaller of its
#   NVLink rate and that network share (planner/sim/resources.py [Note: collective routes]).
#   nccl-tests bear this out on the presets' machines: all-reduce bus bandwidth across DGX nodes is
#   about the NICs' aggregate, 180-190 GB/s on DGX A100 (8 x HDR 200 Gb/s = 200 GB/s) and 350-390
#   GB/s on DGX H100 (8 x NDR 400 Gb/s = 400 GB/s), not one NIC's 25 or 50 GB/s.
#
# The latencies are NCCL's own (tuning.cc, NCCL 2.18, Ring with the Simple protocol, the one it runs
# for the megabyte-and-up tensors of training): base 8.4 us, 3.4 us per NVLink step, 5.7 us per PCIe
# step, 14 us per network step. Tree all-reduce and the LL/LL128 protocols, which NCCL picks for
# small messages, are not modelled: every collective here is a ring.
NCCL_BASE_LATENCY_S = 8.4e-6
"""NCCL tuning.cc baseLat[Ring][Simple]: the fixed cost of launching one ring collective."""
NVLINK_STEP_S = 3.4e-6
"""NCCL tuning.cc hwLat[NVLINK][Ring][Simple]: one ring step between GPUs on NVLink/NVSwitch."""
PCIE_STEP_S = 5.7e-6
"""NCCL tuning.cc hwLat[PCI][Ring][Simple]: one ring step between GPUs over PCIe."""
NETWORK_STEP_S = 14e-6
"""NCCL tuning.cc hwLat[NET][Ring][Simple]: one ring step across the network (InfiniBand/RoCE)."""
PASSES: dict[str, int] = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}
"""Ring passes per collective: an all-reduce is a reduce-scatter then an all-gather."""

# [Note: per-parameter collectives] A ZeRO-3 implementation decides how many collectives a pass over
# the model issues, and each pays the ring's latency above. The runtime, FSDP and today's DeepSpeed
# gather one flat buffer per unit (here: per traced operator, `ShardCollectives.FLAT`) and prefetch
# it during the previous operator's compute. DeepSpeed's ZeRO-3 through 2021 (v0.3.13, its first
# release, to v0.5.x; runtime/zero/partition_parameters.py) did neither:
# - `Init._allgather_param` issues one `all_gather` per `nn.Parameter`: a GPT block's two norms'
#   weights and biases and its four linears' weights and biases are 12 collectives, not 4
#   (`ModelSpec.parameter_tensors_per_block` over the block's linears: each traced operator's
#   gather stands for that many);
# - it calls `torch.cuda.synchronize()` before each of them, and `fetch_sub_module` waits for the
#   gathers and synchronizes again before the module runs: the device drains between every
#   collective and the compute, so no gather overlaps compute (prefetch depth 0: the plan check
#   requires it);
# - `_reduce_scatter_gradient` reduce-scatters each parameter's gradient on its own, so the
#   backward's reduce-scatters are per parameter too.
# The cost is latency, not bytes: the same bytes cross the ring. At fixed global batch the
# micro-batch per GPU shrinks as GPUs are added while each collective's latency grows with the
# ring's ranks, which is how Narayanan et al. 2021's ZeRO-3 runs (Table 2, 384-2,240 A100s) kept a
# near-constant step time as the GPUs doubled.


@dataclass(frozen=True, slots=True)
class Ring:
    """A ring of `ranks` GPUs laid out node by node, `ranks_per_node` of them in each node."""

    ranks: int
    ranks_per_node: int

    @property
    def nodes(self) -> int:
        return max(1, -(-self.ranks // self.ranks_per_node))

    def steps(self, kind: Collective) -> tuple[int, int]:
        """(NVLink steps, network steps) of the collective."""
        if self.ranks <= 1:
            return 0, 0
        passes = PASSES[kind]
        inter = passes * (self.nodes - 1)
        return passes * (self.ranks - 1) - inter, inter

    def received_fraction(self, kind: Collective) -> float:
        """Bytes each rank receives per byte of the tensor ((n - 1) / n per ring pass)."""
        return PASSES[kind] * (self.ranks - 1) / self.ranks if self.ranks > 1 else 0.0


def intra_node_step_s(node: NodeSpec) -> float:
    """NVLink where the node's GPU-GPU rate is above its PCIe host link, else PCIe."""
    return NVLINK_STEP_S if node.gpu_gpu_intra_node_bytes_per_s > node.host_to_gpu_bytes_per_s else PCIE_STEP_S


def latency_s(ring: Ring, kind: Collective, node: NodeSpec) -> float:
    """The collective's latency term: base plus every ring step's."""
    if ring.ranks <= 1:
        return 0.0
    intra, inter = ring.steps(kind)
    return NCCL_BASE_LATENCY_S + intra * intra_node_step_s(node) + inter * NETWORK_STEP_S


def bus_bytes_per_s(ring: Ring, node: NodeSpec, rings_per_node: int) -> float:
    """The rate a rank receives its bytes at: NVLink, capped by the ring's share of the node's
    network when it spans nodes (`rings_per_node` rings cross each node at once)."""
    intra = node.gpu_gpu_intra_node_bytes_per_s or node.gpu_hbm_bytes_per_s
    if ring.nodes <= 1:
        return intra
    if not node.inter_node_bytes_per_s:
        return 0.0
    return min(intra, node.inter_node_bytes_per_s / max(1, rings_per_node))


def collective_s(ring: Ring, kind: Collective, tensor_bytes: float, node: NodeSpec, rings_per_node: int = 1) -> float:
    """Seconds of one ring collective of `tensor_bytes` ([Note: the alpha-beta collective])."""
    if ring.ranks <= 1 or tensor_bytes <= 0:
        return 0.0
    rate = bus_bytes_per_s(ring, node, rings_per_node)
    received = ring.received_fraction(kind) * tensor_bytes
    return latency_s(ring, kind, node) + (received / rate if rate > 0 else float("inf"))


def data_parallel_ring(plan: Plan) -> Ring:
    """The ring of a plan's data-parallel group: `dp` ranks, one per replica, the node's GPUs
    split among `mp` rings (one per tensor-parallel index)."""
    per_node = max(1, plan.cluster.gpus_per_node // plan.model_parallel_degree)
    return Ring(plan.data_parallel_degree, min(per_node, plan.data_parallel_degree))


def data_parallel_rings_per_node(plan: Plan) -> int:
    """How many data-parallel rings cross each node's network at once: one per tensor-parallel
    index the node holds."""
    return min(plan.model_parallel_degree, plan.cluster.gpus_per_node)


def tensor_parallel_ring(plan: Plan) -> Ring:
    """Megatron's tensor-parallel group: `mp` GPUs inside one node."""
    return Ring(plan.model_parallel_degree, plan.model_parallel_degree)


def collectives_per_operator(plan: Plan) -> float:
    """Data-parallel collectives that one traced operator's gather (or gradient reduce-scatter)
    stands for ([Note: per-parameter collectives]): 1 with flat gathers; per parameter, the block's
    parameter tensors over its linears."""
    if plan.shard_collectives is not ShardCollectives.PER_PARAMETER:
        return 1.0
    model = plan.model
    return model.parameter_tensors_per_block / len(model.block_operators())
