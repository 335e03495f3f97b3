"""The links of one simulated node and the route (hops with weights) of every kind of transfer.

Per GPU: its compute, its host link in each direction (PCIe, two independent links), its GPU-GPU
collective port (NVLink/NVSwitch), and where host state crosses, the rank's host threads: the one
that memcpys pageable state into the staging pool (`host_memcpy`) and the transfer worker that adds
landing gradients into fp32 host shards (`host_landing`; planner/cost/host_link.py [Note: staged
and pinned host copies]). Per node: the host-memory/PCIe aggregate every host transfer also crosses, the
links of each staged tier (NVMe: reads and writes independent or sharing one device budget,
`Tier.shares_read_write_budget`), the CPU optimizer, and the network port for collectives that span
nodes. A tier's own link is routed by `read` / `write` ([Note: tiers as types] in planner/specs/tiers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.cost.host_link import host_memcpy_bytes_per_s, landing_bytes_per_s, landing_host_bytes_per_byte
from planner.cost.memory import host_state_crosses_link, stores_gradients
from planner.sim.network import Link
from planner.specs.hardware import NodeSpec
from planner.specs.plan import Plan
from planner.specs.tiers import TIERS, Tier

Hops = tuple[tuple[Link, float], ...]

COMPUTE = "gpu_compute"
"""The name of a rank's compute link (its busy intervals are the GPU's work)."""


@dataclass(eq=False, slots=True)
class RankLinks:
    """The per-GPU links of one simulated rank."""

    compute: Link
    h2d: Link
    d2h: Link
    gpu_gpu: Link
    memcpy: Link | None = None
    """The launching thread's memcpy into the staging pool (None where nothing is staged)."""
    landing: Link | None = None
    """The transfer worker's add of landing gradients into fp32 host shards (None where none land)."""

    def links(self) -> list[Link]:
        return [self.compute, self.h2d, self.d2h, self.gpu_gpu,
                *(link for link in (self.memcpy, self.landing) if link is not None)]


class StoreLinks:
    """A staged tier's per-node links: one each way, or one device budget both directions share.
    `ranks_weight` GPUs stand behind each simulated flow."""

    def __init__(self, tier: Tier, node: NodeSpec, ranks_weight: float) -> None:
        read_bw, write_bw = tier.link_rates(node)
        self.shared = tier.shares_read_write_budget(node)
        if self.shared:
            link = Link(str(tier), 1.0, unit="device-s", scope="per node")
            self.read_link, self.write_link = link, link
            # Shared budget: a byte read costs 1/read_bw device-seconds, a byte written 1/write_bw.
            self.read_weight, self.write_weight = ranks_weight / read_bw, ranks_weight / write_bw
        else:
            self.read_link = Link(tier.read_link, read_bw, scope="per node")
            self.write_link = Link(tier.write_link, write_bw, scope="per node")
            self.read_weight = self.write_weight = ranks_weight

    def links(self) -> list[Link]:
        return [self.read_link] if self.shared else [self.read_link, self.write_link]


class NodeResources:
    """Links of one node, shared by `ranks` simulated ranks that stand for `gpus_per_node` GPUs.

    `ranks_weight` is how many GPUs one simulated rank stands for on the node-wide links: 1 when
    every GPU of the node is simulated, `gpus_per_node` for a representative rank.
    """

    def __init__(self, plan: Plan, num_ranks: int) -> None:
        node = plan.node
        gpus = plan.cluster.gpus_per_node
        assert gpus % num_ranks == 0, "simulated ranks must stand for equal shares of the node"
        self.ranks_weight = gpus / num_ranks
        self.host_memory = Link("host_memory", node.host_memory_bytes_per_s, scope="per node")
        self.stores = {tier: StoreLinks(tier, node, self.ranks_weight) for tier in TIERS if tier.staged}
        self.cpu_optimizer = Link("cpu_optimizer", node.cpu_adam_params_per_s, unit="params", scope="per node")
        self._adam_hops = self._cpu_adam_hops(plan)
        self._landing_weight = self.ranks_weight * (landing_host_bytes_per_byte(plan) if node.host_memory_is_measured
                                                    else 1.0)
        self.inter_node = Link("inter_node", node.inter_node_bytes_per_s, scope="per node") if plan.num_nodes > 1 else None
        self.ranks = [
            RankLinks(
                compute=Link(COMPUTE, node.gpu_flops_per_s, unit="flop", scope=f"per GPU{_rank_tag(r, num_ranks)}"),
                h2d=Link("h2d", node.host_to_gpu_bytes_per_s, scope=f"per GPU{_rank_tag(r, num_ranks)}"),
                d2h=Link("d2h", node.gpu_to_host_bytes_per_s, scope=f"per GPU{_rank_tag(r, num_ranks)}"),
                gpu_gpu=Link("gpu_gpu", node.gpu_gpu_intra_node_bytes_per_s or node.host_to_gpu_bytes_per_s,
                             scope=f"per GPU{_rank_tag(r, num_ranks)}"),
            )
            for r in range(num_ranks)
        ]
        self._host_threads(plan, num_ranks)
        # [Note: collective routes] A data-parallel ring collective moves, per GPU, what the GPU
        # receives, X = (n-1)/n of the tensor, over its NVLink port. NCCL lays the ring out node by
        # node and spreads it over one channel per NIC, so a ring crosses each node boundary once
        # per pass and the node's NICs share that crossing: the node's network carries X per ring,
        # and the node holds `mp` rings (one per tensor-parallel index), so mp * X, the
        # hierarchical ring (planner/cost/collectives.py [Note: the alpha-beta collective], with
        # nccl-tests' inter-node bus bandwidths as the evidence). The representative rank's flow
        # weighs mp on the port; each of `gpus` explicit ranks weighs mp / gpus.
        self._inter_weight = min(plan.model_parallel_degree, gpus) / num_ranks

    def links(self) -> list[Link]:
        node_links = [self.host_memory, self.cpu_optimizer]
        node_links += [link for store in self.stores.values() for link in store.links()]
        if self.inter_node is not None:
            node_links.append(self.inter_node)
        return node_links + [link for rank in self.ranks for link in rank.links()]

    def _host_threads(self, plan: Plan, num_ranks: int) -> None:
        """The rank's host threads that copies cross where host state does ([Note: staged and pinned
        host copies] in planner/cost/host_link.py)."""
        node = plan.node
        if node.host_is_device:
            return
        pooled = host_state_crosses_link(plan)
        landed = plan.placement.gradients.host_memory and stores_gradients(plan)
        for r, rank in enumerate(self.ranks):
            scope = f"per GPU{_rank_tag(r, num_ranks)}"
            if pooled:
                rank.memcpy = Link("host_memcpy", host_memcpy_bytes_per_s(node), scope=scope)
            if landed:
                rank.landing = Link("host_landing", landing_bytes_per_s(plan), scope=scope)

    # -- routes ------------------------------------------------------------------------------
    def read(self, tier: Tier, rank: int) -> Hops:
        """Bytes leaving `tier` toward the GPU over its own link (`Tier.read_link`): a staged tier's
        per-node link, or the rank's host link for host memory."""
        store = self.stores.get(tier)
        return ((store.read_link, store.read_weight),) if store is not None else self.h2d(rank)

    def write(self, tier: Tier, rank: int) -> Hops:
        """Bytes entering `tier` from the GPU's side over its own link (`Tier.write_link`)."""
        store = self.stores.get(tier)
        return ((store.write_link, store.write_weight),) if store is not None else self.d2h(rank)

    def h2d(self, rank: int) -> Hops:
        return ((self.ranks[rank].h2d, 1.0), (self.host_memory, self.ranks_weight))

    def d2h(self, rank: int) -> Hops:
        return ((self.ranks[rank].d2h, 1.0), (self.host_memory, self.ranks_weight))

    def staged_h2d(self, rank: int) -> Hops:
        """Pageable host state to the GPU through the staging pool: the thread's memcpy, then the link."""
        memcpy = self.ranks[rank].memcpy
        return self.h2d(rank) + (((memcpy, 1.0),) if memcpy is not None else ())

    def staged_d2h(self, rank: int) -> Hops:
        """GPU to pageable host state through the staging pool: the link, then the memcpy out of it."""
        memcpy = self.ranks[rank].memcpy
        return self.d2h(rank) + (((memcpy, 1.0),) if memcpy is not None else ())

    def landed_d2h(self, rank: int) -> Hops:
        """A gradient shard off the GPU, added into its fp32 host shard by the transfer worker as it lands."""
        landing = self.ranks[rank].landing
        if landing is None:
            return self.d2h(rank)
        # The host memory carries the DMA's write and the add's reads and write (host_link.py
        # `landing_host_bytes_per_byte`), not only the link's bytes.
        return ((self.ranks[rank].d2h, 1.0), (self.host_memory, self._landing_weight), (landing, 1.0))

    def collective(self, rank: int, *, spans_nodes: bool) -> Hops:
        """A data-parallel ring collective (see [Note: collective routes])."""
        port = ((self.ranks[rank].gpu_gpu, 1.0),)
        if spans_nodes and self.inter_node is not None:
            return port + ((self.inter_node, self._inter_weight),)
        return port

    def tensor_parallel(self, rank: int) -> Hops:
        """Megatron all-reduces stay inside the node (mp <= GPUs per node)."""
        return ((self.ranks[rank].gpu_gpu, 1.0),)

    def cpu_adam(self) -> Hops:
        return self._adam_hops

    # [Note: CPU Adam shares the host memory] Fused AdamW streams its four fp32 tensors through DRAM:
    # `planner probe` times it over a working set beyond the CPU's caches (runtime/probe.py [Note: host
    # measurements beyond the cache]), so at its probed rate it keeps the host memory busy, and a host
    # copy running beside it (a gradient landing, a parameter shard crossing to the GPU) takes memory
    # time from it, and it from them. So where the optimizer states are resident in host memory an
    # Adam parameter also weighs on the node's host-memory link for the bytes that link carries in
    # Adam's time alone (`host_memory_bytes_per_s / cpu_adam_params_per_s`): alone it runs at its
    # probed rate as before; beside the copies the fluid model shares the memory between them. The
    # step's own host copies are counted in Adam's parameters (planner/cost/host_work.py), so they
    # weigh there at their bytes. Only where the spec's host-memory rate is the memory's own
    # (`NodeSpec.host_memory_is_measured`): a preset's is a figure for the GPUs' host traffic, which
    # the CPU's passes do not cross; there a landing weighs its link bytes only, as before.
    # With the states on NVMe the step's pace is the drive's (CPU Adam a
    # small share of a chunk's time), and the update stream stays off the host memory: its coupling
    # to the compute stream through the drive alone is what [Note: two streams] in streams.py
    # extrapolates. Measurements: docs/notes/2026-11-28-offload-prediction-h200.md.
    def _cpu_adam_hops(self, plan: Plan) -> Hops:
        node = plan.node
        adam = ((self.cpu_optimizer, self.ranks_weight),)
        if (plan.placement.optimizer_states.staged or not node.host_memory_is_measured
                or node.host_memory_bytes_per_s <= 0 or node.cpu_adam_params_per_s <= 0):
            return adam
        memory_per_param = node.host_memory_bytes_per_s / node.cpu_adam_params_per_s
        return (*adam, (self.host_memory, self.ranks_weight * memory_per_param))


def _rank_tag(rank: int, num_ranks: int) -> str:
    return "" if num_ranks == 1 else f" (simulated rank {rank})"
