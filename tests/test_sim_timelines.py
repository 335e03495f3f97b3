"""Exact simulated timelines on tiny hand-computable plans (planner.sim.engine / optimizer)."""

import dataclasses

import pytest

from planner.sim import simulate
from planner.sim.engine import Simulation, stage_lookahead
from planner.sim.optimizer import _run, chunked_step
from planner.sim.workload import OpShape, Step, build_workload
from planner.specs.hardware import NodeSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Placement, Plan
from planner.specs.tiers import HOST, NVME


def tiny_node(**overrides) -> NodeSpec:
    """Round numbers in base units (bytes/s, flop/s) so every duration is exact in binary; a host thread
    copies far faster than the links and the host memory is far faster than both, so staged copies and
    gradient landings run at the links' rates and the CPU step's host copies take no time (the tests
    that price the host memory set its rate)."""
    base = dict(name="tiny", num_gpus_per_node=1, gpu_memory_bytes=2**30, gpu_flops_per_s=2.0, gpu_hbm_bytes_per_s=2.0**40,
                host_memcpy_bytes_per_s=2.0**40,
                cpu_memory_bytes=2**30, nvme_capacity_bytes=2**30, host_to_gpu_bytes_per_s=2.0,
                gpu_to_host_bytes_per_s=2.0, host_memory_bytes_per_s=2.0**40, nvme_read_bytes_per_s=2.0,
                nvme_write_bytes_per_s=2.0, gpu_gpu_intra_node_bytes_per_s=1024.0, cpu_adam_params_per_s=4.0,
                nvme_read_write="independent")
    base.update(overrides)
    return NodeSpec(**base)


ONE_LAYER = ModelSpec(name="one-layer", num_layers=1, hidden_size=1, num_heads=1, seq_len=1)
CPU_OFFLOAD = Placement(params="cpu", gradients="cpu", optimizer_states="cpu", recompute_inputs="gpu")


def rounded(log, keep):
    return [(name, round(a, 9), round(b, 9), label) for name, a, b, label in log if name in keep]


def test_one_layer_known_bandwidths_give_known_iteration_time():
    # One block of a width-1 model, bf16, batch 1, seq 1: linears qkv 3, attn_out 1, mlp_up 4, mlp_down
    # 4 weights (6, 2, 8, 8 bytes); forward flops 2 * params, attn_out also 4 attention flops. PCIe
    # 2 B/s each way, 2 flop/s, CPU Adam 4 params/s. Depth 0, no recompute: every step is
    # fetch -> compute (-> gradient offload), in sequence.
    plan = Plan(model=ONE_LAYER, node=tiny_node(), num_gpus=1, placement=CPU_OFFLOAD, recompute_interval=0,
                prefetch_depth=0)
    result = simulate(plan)
    log = rounded(result.simulation.log(), {"h2d", "gpu_compute", "d2h", "cpu_optimizer"})
    assert log == [
        ("h2d", 0, 3, "forward"), ("gpu_compute", 3, 6, "forward"),        # qkv: 6 B, 6 flop
        ("h2d", 6, 7, "forward"), ("gpu_compute", 7, 10, "forward"),       # attn_out: 2 B, 2 + 4 flop
        ("h2d", 10, 14, "forward"), ("gpu_compute", 14, 18, "forward"),    # mlp_up: 8 B, 8 flop
        ("h2d", 18, 22, "forward"), ("gpu_compute", 22, 26, "forward"),    # mlp_down
        ("h2d", 26, 30, "backward"), ("gpu_compute", 30, 38, "backward"),  # mlp_down: 2x flops
        ("d2h", 38, 42, "backward"),                                        # its 8 B gradient
        ("h2d", 42, 46, "backward"), ("gpu_compute", 46, 54, "backward"), ("d2h", 54, 58, "backward"),
        ("h2d", 58, 59, "backward"), ("gpu_compute", 59, 65, "backward"), ("d2h", 65, 66, "backward"),
        ("h2d", 66, 69, "backward"), ("gpu_compute", 69, 75, "backward"), ("d2h", 75, 78, "backward"),
        ("cpu_optimizer", 78, 81, "optimizer"),                             # 12 params at 4/s
    ]
    p = result.prediction
    assert p.iteration_time_s == pytest.approx(81.0, abs=1e-9)
    assert p.phase_time_s == pytest.approx({"forward": 26.0, "backward": 52.0, "optimizer": 3.0})
    assert p.link_bytes == {"nvme_read": 0, "nvme_write": 0, "h2d": 48, "d2h": 24, "all_gather": 0, "reduce_scatter": 0}
    # Paper accounting without recompute: 6 * tokens * params = 6 * 1 * 12 flop in 81 s.
    assert p.tflops_per_gpu == pytest.approx(72 / 81 / 1e12)
    assert p.method == "simulated" and p.feasible


def test_two_gpus_sharing_the_host_fabric_take_twice_as_long_per_transfer():
    # Two GPUs, each with a 2 B/s lane; the node's host fabric carries 2 B/s in all (docs/method.md §5: the
    # per-GPU rate when every GPU reads at once is the aggregate over the GPU count).
    def first_h2d(host_memory, ranks):
        node = tiny_node(num_gpus_per_node=2, host_memory_bytes_per_s=host_memory)
        plan = Plan(model=ONE_LAYER, node=node, num_gpus=2, placement=CPU_OFFLOAD, recompute_interval=0, prefetch_depth=0)
        sim = Simulation(plan, ranks=ranks).run()
        return next((a, b) for name, a, b, _ in sim.log() if name == "h2d")

    # qkv's 6 bytes split over 2 ranks: 3 B per rank.
    assert first_h2d(4.0, "representative") == (0.0, 1.5)  # fabric wide enough: the lane's 2 B/s
    assert first_h2d(2.0, "representative") == (0.0, 3.0)  # fabric shared by two: 1 B/s each
    assert first_h2d(2.0, "explicit") == (0.0, 3.0)


def _forward_only(plan: Plan, num_steps: int, num_params: int, flops: float):
    """A workload of identical forward operators, nothing to reduce or update."""
    op = OpShape(name="linear", num_params=num_params, flops_per_gpu=flops, tp_all_reduce=False)
    steps = tuple(Step(index=i, phase="forward", op=op, block=-1, segment=-1) for i in range(num_steps))
    return dataclasses.replace(build_workload(plan), steps=steps, params_per_rank=0.0)


def _depth_plan(depth: int) -> Plan:
    node = tiny_node(nvme_read_bytes_per_s=4.0, host_to_gpu_bytes_per_s=16.0, host_memory_bytes_per_s=1024.0,
                     gpu_flops_per_s=8.0)
    placement = Placement(params="nvme", gradients="gpu", optimizer_states="gpu", recompute_inputs="gpu")
    return Plan(model=ONE_LAYER, node=node, num_gpus=1, placement=placement, prefetch_depth=depth)


def test_stage_lookaheads_follow_method_4_3():
    # (NVMe read: 2 hops from the GPU, host copy: 1 hop, all-gather) operators ahead, by depth.
    def ahead(depth):
        return tuple(stage_lookahead(depth, hops) for hops in (NVME.hops_to_gpu, HOST.hops_to_gpu, 0))

    assert ahead(3) == (3, 2, 1)
    assert ahead(0) == (0, 0, 0)
    assert ahead(1) == (1, 1, 1)
    assert ahead(5) == (5, 4, 3)


def test_prefetch_depth_0_vs_3_on_a_transfer_bound_case():
    # Four operators of 2 weights (4 B): NVMe read 1 s, host-to-GPU 0.25 s, compute 0.75 s.
    def run(depth, num_steps=4):
        plan = _depth_plan(depth)
        sim = Simulation(plan, workload=_forward_only(plan, num_steps, 2, 6.0)).run()
        return sim

    serial = run(0)
    assert serial.iteration_time_s == pytest.approx(8.0)  # 4 x (1 + 0.25 + 0.75), nothing overlaps
    assert rounded(serial.log(), {"nvme_read", "h2d", "gpu_compute"})[:3] == [
        ("nvme_read", 0, 1, "forward"), ("h2d", 1, 1.25, "forward"), ("gpu_compute", 1.25, 2, "forward")]

    piped = run(3)
    # Depth 3: before operator 0 the reads of 0..3 and the copies of 0..2 are issued; the four reads
    # share the drive (4 x 1 s of work -> all land at 4 s), the three copies share the lane (0.75 s),
    # then computes run back to back while the copy of operator 3 (issued at step 1) overlaps them.
    assert rounded(piped.log(), {"nvme_read", "h2d", "gpu_compute"}) == [
        ("nvme_read", 0, 4, "forward"), ("h2d", 4, 4.75, "forward"), ("gpu_compute", 4.75, 5.5, "forward"),
        ("h2d", 5.5, 5.75, "forward"), ("gpu_compute", 5.5, 6.25, "forward"),
        ("gpu_compute", 6.25, 7, "forward"), ("gpu_compute", 7, 7.75, "forward")]
    assert piped.iteration_time_s == pytest.approx(7.75)
    # With more operators the pipeline's advantage grows: transfers overlap compute in steady state.
    assert run(3, 16).iteration_time_s < run(0, 16).iteration_time_s - 4.0


def _optimizer_plan(buffers: int, nvme: str) -> Plan:
    # 12 * 1 * 8^2 = 768 weights in 3 chunks of 256 (4096 B buffers: master, momentum, variance,
    # gradient). The runtime reads and writes the 12 B/param in the optimizer's tier (the gradient
    # stays on the CPU here): 3072 B per chunk, 2 s alone each way; updating it: 1 s. Host memory
    # fast enough that the step's host copies take no time: the chunk pipeline alone here
    # (test_sim_in_backward's timelines time them, planner/cost/host_work.py).
    model = ModelSpec(name="tiny-768", num_layers=1, hidden_size=8, num_heads=1, seq_len=1)
    node = tiny_node(nvme_read_bytes_per_s=1536.0, nvme_write_bytes_per_s=1536.0, cpu_adam_params_per_s=256.0,
                     nvme_read_write=nvme, host_memory_bytes_per_s=2.0**60)
    placement = Placement(params="cpu", gradients="cpu", optimizer_states="nvme", recompute_inputs="gpu")
    return Plan(model=model, node=node, num_gpus=1, placement=placement, optimizer_chunk_bytes=4096,
                num_optimizer_buffers=buffers)


def _optimizer_log(plan: Plan):
    sim = _run(plan, build_workload(plan), 1, [256.0, 256.0, 256.0])
    return sim.duration_s, rounded([(link.name, a, b, lab) for link in sim.links() for a, b, lab in link.intervals],
                                   {"nvme_read", "nvme_write", "cpu_optimizer", "nvme"})


def test_nvme_optimizer_chunk_pipeline_overlaps_read_update_write():
    duration, log = _optimizer_log(_optimizer_plan(3, "independent"))
    assert duration == pytest.approx(9.0)  # read k+1, update k, write k-1 at once
    assert sorted(log, key=lambda e: (e[1], e[0])) == [
        ("nvme_read", 0, 2, "optimizer"),                                         # read 0
        ("cpu_optimizer", 2, 3, "optimizer"), ("nvme_read", 2, 4, "optimizer"),   # update 0, read 1
        ("nvme_write", 3, 5, "optimizer"),                                        # write 0
        ("cpu_optimizer", 4, 5, "optimizer"), ("nvme_read", 4, 6, "optimizer"),   # update 1, read 2
        ("nvme_write", 5, 7, "optimizer"),
        ("cpu_optimizer", 6, 7, "optimizer"), ("nvme_write", 7, 9, "optimizer")]


def test_one_buffer_serialises_the_chunk_pipeline():
    duration, _ = _optimizer_log(_optimizer_plan(1, "independent"))
    assert duration == pytest.approx(15.0)  # 3 x (2 + 1 + 2)


def test_shared_nvme_budget_slows_overlapped_reads_and_writes():
    # Reads and writes split one drive: read 1 and write 0 overlap from 3 s at half speed each, ...
    duration, log = _optimizer_log(_optimizer_plan(3, "shared"))
    assert duration == pytest.approx(12.0)
    assert [e for e in log if e[0] == "cpu_optimizer"] == [
        ("cpu_optimizer", 2, 3, "optimizer"), ("cpu_optimizer", 5, 6, "optimizer"), ("cpu_optimizer", 9, 10, "optimizer")]


def test_periodic_optimizer_extrapolation_matches_full_simulation():
    plan = _optimizer_plan(3, "shared").replace(model=ModelSpec(name="m", num_layers=1, hidden_size=64, num_heads=1))
    work = build_workload(plan)
    fast = chunked_step(plan, work, 1)
    assert fast.extrapolated and fast.num_chunks == 192
    full = _run(plan, work, 1, [256.0] * 192).outcome()
    assert fast.duration_s == pytest.approx(full.duration_s, rel=1e-9)
    assert fast.busy_s == pytest.approx(full.busy_s, rel=1e-9)
    assert fast.amount == pytest.approx(full.amount, rel=1e-9)
    assert fast.link_bytes == pytest.approx(full.link_bytes, rel=1e-9)
    assert sum(d for _, _, d in fast.cpu_changes) == pytest.approx(0.0)
    assert max(_running(fast.cpu_changes)) == pytest.approx(max(_running(full.cpu_changes)))


def _running(changes):
    total, out = 0.0, []
    for _, _, d in changes:
        total += d
        out.append(total)
    return out


@pytest.mark.parametrize(("num_gpus", "mp", "placement"), [
    (4, 1, Placement(params="nvme", gradients="nvme", optimizer_states="nvme", recompute_inputs="cpu")),
    (8, 2, Placement(params="cpu", gradients="cpu", optimizer_states="cpu", recompute_inputs="cpu")),  # 2 nodes
])
def test_representative_rank_equals_every_rank_simulated(num_gpus, mp, placement):
    # [Note: representative rank]: nodes of 4 GPUs, every transfer kind, efficiency curves, recompute
    # inputs on CPU; with two nodes the all-gathers and reduce-scatters also cross the network port.
    from planner.specs.catalog import hardware_presets

    node = hardware_presets()["dgx2-v100"].replace(num_gpus_per_node=4)
    model = ModelSpec(name="small", num_layers=3, hidden_size=256, num_heads=4, seq_len=64)
    plan = Plan(model=model, node=node, num_gpus=num_gpus, placement=placement, micro_batch_per_gpu=2,
                recompute_interval=2, model_parallel_degree=mp, optimizer_chunk_bytes=65536)
    rep, every = simulate(plan).prediction, simulate(plan, ranks="explicit").prediction
    assert every.details["simulated_ranks"] == 4 and rep.details["simulated_ranks"] == 1
    assert rep.iteration_time_s == pytest.approx(every.iteration_time_s, rel=1e-9)
    assert rep.phase_time_s == pytest.approx(every.phase_time_s, rel=1e-9)
    assert rep.link_bytes == every.link_bytes
    assert rep.details["simulated_peak_bytes"] == pytest.approx(every.details["simulated_peak_bytes"], rel=1e-9)


@pytest.mark.parametrize(("hidden", "layers", "ci", "placement", "mp", "tiling", "gpus", "periodic"), [
    # Across nodes (8 here, 4 for mp 4 below): the all-gathers cross the network port as hierarchical
    # rings with NCCL's latency ([Note: collective routes]). On 4 nodes this plan's gathers and NVMe
    # reads take longer than the sampled units to settle, and the fast path simulates every block.
    (2048, 20, 1, Placement(params="nvme", gradients="nvme", optimizer_states="nvme", recompute_inputs="cpu"), 1, 1,
     64, True),
    (512, 23, 3, Placement(params="cpu", gradients="cpu", optimizer_states="nvme", recompute_inputs="cpu"), 2, 2, 16,
     True),
    (512, 17, 0, Placement(), 1, 1, 16, True),
    (512, 31, 4, Placement(params="nvme", gradients="cpu", optimizer_states="cpu", recompute_inputs="gpu"), 4, 1, 32,
     True),
    # Tiny transfers: with the hand-set A100 rates the recompute-input offloads drifted against the fetches
    # and the fast path fell back to every block; with the fitted rates (planner/validation/fit.py: slower
    # small matmuls) compute hides them and the blocks repeat.
    (512, 20, 1, Placement(params="nvme", gradients="nvme", optimizer_states="nvme", recompute_inputs="cpu"), 1, 1,
     16, True),
])
def test_periodic_layer_extrapolation_matches_full_simulation(hidden, layers, ci, placement, mp, tiling, gpus, periodic):
    # [Note: periodic layers]: the fast path samples 2 shallower models and extrapolates exactly.
    from planner.sim.fast import predict
    from planner.sim.periodic import sample_units
    from planner.specs.catalog import hardware_presets

    model = ModelSpec(name="deep", num_layers=layers, hidden_size=hidden, num_heads=8, seq_len=128, vocab_size=1000)
    plan = Plan(model=model, node=hardware_presets()["dgx-a100-80g"], num_gpus=gpus, placement=placement,
                micro_batch_per_gpu=2, recompute_interval=ci, model_parallel_degree=mp, tiling_factor=tiling,
                optimizer_chunk_bytes=2**20)
    assert sample_units(plan) is not None
    fast, full = predict(plan), simulate(plan).prediction
    assert ("extrapolated_from_layers" in fast.details) == periodic
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-9)
    assert fast.phase_time_s == pytest.approx(full.phase_time_s, rel=1e-9)
    assert fast.details["simulated_peak_bytes"] == pytest.approx(full.details["simulated_peak_bytes"], rel=1e-9)
    assert fast.link_bytes == pytest.approx(full.link_bytes, rel=1e-9)
    fast_terms, full_terms = fast.details["simulated_memory_terms"], full.details["simulated_memory_terms"]
    assert fast_terms.keys() == full_terms.keys()
    for tier in full_terms:
        assert fast_terms[tier] == pytest.approx(full_terms[tier], rel=1e-9)
    for name, r in full.details["resources"].items():
        assert fast.details["resources"][name]["busy_s"] == pytest.approx(r["busy_s"], rel=1e-9)
    assert (fast.bottleneck, fast.feasible) == (full.bottleneck, full.feasible)


def test_all_gather_across_nodes_is_capped_by_the_network_port():
    # Two nodes of one GPU, dp = 2, params on the GPUs: each forward step all-gathers its operator;
    # each rank receives half of it. qkv's 6 B -> 3 B per rank. GPU port 1024 B/s, network 1 B/s
    # per node, one GPU per node ([Note: collective routes]: the node's network caps the ring): 3 s, not
    # 3/1024, after the ring's latency: NCCL's base 8.4 us and one network step of 14 us (n - 1 = 1).
    node = tiny_node(inter_node_bytes_per_s=1.0, gpu_gpu_intra_node_bytes_per_s=1024.0)
    placement = Placement(params="gpu", gradients="gpu", optimizer_states="gpu", recompute_inputs="gpu")
    plan = Plan(model=ONE_LAYER, node=node, num_gpus=2, placement=placement, recompute_interval=0, prefetch_depth=0)
    sim = Simulation(plan).run()
    first = next((a, b) for name, a, b, _ in sim.log() if name == "inter_node")
    assert first == pytest.approx((22.4e-6, 3.0 + 22.4e-6), rel=1e-12)
    assert next((a, b) for name, a, b, _ in sim.log() if name == "gpu_gpu") == first


def test_refine_ranks_by_simulated_throughput_and_keeps_the_analytic_numbers():
    from planner.search.refine import refine
    from planner.search.search import SearchRequest, search
    from planner.specs.catalog import hardware_presets, resolve_model

    result = search(SearchRequest(model=resolve_model("13B"), node=hardware_presets()["dgx2-v100"], num_gpus=16))
    refined = refine(result, top=4)
    head = refined.ranked[:4]
    assert all(p.prediction.method == "simulated" for p in head)
    rates = [p.prediction.tokens_per_s for p in head]  # ranked by rate (ties, to rounding, by rank_key)
    assert all(a >= b * (1 - 1e-12) for a, b in zip(rates, rates[1:], strict=False))
    assert len({(p.strategy, p.placement, p.optimizer_step) for p in head}) == 4  # distinct candidates (refine's key)
    assert all("analytic" in p.prediction.details for p in head)
    assert len(refined.ranked) == len(result.ranked)
    assert all(p.prediction.feasible for p in head)  # the bill's verdict is kept


def test_refine_keeps_the_analytic_prediction_when_the_simulator_cannot_time_a_plan():
    from planner.search.refine import refine
    from planner.search.search import SearchRequest, search
    from planner.specs.catalog import hardware_presets, resolve_model

    node = hardware_presets()["dgx2-v100"].replace(gpu_hbm_bytes_per_s=0.0)  # GPU Adam needs the HBM rate
    result = search(SearchRequest(model=resolve_model("1.4B"), node=node, num_gpus=16, strategy="zero3"))
    refined = refine(result, top=2)
    assert refined.ranked[0].prediction.method == "analytic"
