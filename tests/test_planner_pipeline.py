"""Pipeline parallelism (1F1B), the step of m micro-batches, the collectives and fp8 matmuls
(planner/cost/pipeline.py, planner/cost/fp8.py): each term by hand, and the estimate and the simulator on it."""

import json

import pytest

from planner.cost.feasibility import check_plan
from planner.cost.fp8 import cast_bytes, fp8_speedup
from planner.cost.kernels import achievable_hbm_bytes_per_s
from planner.cost.memory import memory_bill
from planner.cost.pipeline import (
    bubble_fraction,
    compose_step,
    in_flight_micro_batches,
    p2p_bytes_per_gpu,
    p2p_bytes_per_s,
    p2p_s,
    stage_model,
    stage_plan,
)
from planner.cost.throughput import estimate, model_compute
from planner.sim.fast import predict
from planner.specs.catalog import hardware_presets
from planner.specs.errors import PlannerError
from planner.specs.hardware import NodeSpec
from planner.specs.memory_terms import MemoryTerm
from planner.specs.model import ModelSpec
from planner.specs.plan import STRATEGY_TABLE, Placement, Plan
from planner.specs.units import GB, GIB

NODE = NodeSpec(name="round", num_gpus_per_node=4, gpu_memory_bytes=64 * GIB, gpu_flops_per_s=1e12,
                gpu_hbm_bytes_per_s=1000 * GB, cpu_memory_bytes=512 * GIB, nvme_capacity_bytes=4096 * GIB,
                host_to_gpu_bytes_per_s=10 * GB, gpu_to_host_bytes_per_s=10 * GB, host_memory_bytes_per_s=40 * GB,
                nvme_read_bytes_per_s=4 * GB, nvme_write_bytes_per_s=2 * GB, gpu_gpu_intra_node_bytes_per_s=100 * GB,
                inter_node_bytes_per_s=40 * GB, cpu_adam_params_per_s=1e9)
MODEL = ModelSpec(name="eight", num_layers=8, hidden_size=1024, num_heads=8, seq_len=512, vocab_size=4096)


def plan(**kw):
    base = dict(model=MODEL, node=NODE, num_gpus=8, strategy="3d", model_parallel_degree=2, pipeline_parallel_degree=2,
                micro_batches_per_step=8, micro_batch_per_gpu=0.25, recompute_interval=1)
    base.update(kw)
    return Plan(**base)


def test_bubble_fraction_is_p_minus_1_over_m_and_shrinks_with_interleaving():
    assert bubble_fraction(4, 16) == 3 / 16
    assert bubble_fraction(1, 5) == 0
    assert bubble_fraction(8, 64, virtual_stages=4) == 7 / 256


def test_the_step_has_m_plus_p_minus_1_micro_batch_slots():
    # dp 2 with a once-per-step reduction: 8 + 1 - 1 = 8 quiet slots, the last one reduces.
    p = plan()
    step = compose_step(p, (1.0, 2.0, 0.5), (0.9, 1.8))
    send = p2p_s(p)
    assert step.slots == 9 and step.quiet_slots == 8
    assert step.forward_s == pytest.approx(1.0 + 8 * 0.9 + 9 * send / 2)
    assert step.backward_s == pytest.approx(2.0 + 8 * 1.8 + 9 * send / 2)
    assert step.optimizer_s == 0.5
    # A sharded strategy (FSDP / ZeRO-3) gathers and reduces in every micro-batch: no quiet slot.
    zero3 = plan(strategy="zero3")
    assert compose_step(zero3, (1.0, 2.0, 0.5), None).quiet_slots == 0


def test_p2p_bytes_are_the_replicas_activations_over_the_tensor_group():
    # Replica micro-batch 0.25 x tp 2 x pp 2 = 1 sample: 1 x 512 x 1024 bf16 = 1 MiB, half per GPU.
    p = plan()
    assert p2p_bytes_per_gpu(p) == 512 * 1024 * 2 / 2
    assert p2p_bytes_per_gpu(plan(pipeline_parallel_degree=1, micro_batch_per_gpu=0.5)) == 0
    # 8 GPUs on 4-GPU nodes: the boundary crosses nodes at each GPU's share of the network.
    assert p2p_bytes_per_s(p) == 40 * GB / 4
    # Two sends (activations, their gradients), each after NCCL's base 8.4 us and one network step 14 us.
    assert p2p_s(p) == pytest.approx(2 * (512 * 1024 / (10 * GB) + 22.4e-6))
    one_node = plan(num_gpus=4, micro_batch_per_gpu=0.5)
    assert p2p_bytes_per_s(one_node) == 100 * GB  # NVLink
    interleaved = plan(pipeline_virtual_stages=2)
    assert p2p_s(interleaved) == 2 * p2p_s(p)


def test_each_stage_holds_its_layers_and_one_vocabulary_matrix():
    p = plan(pipeline_parallel_degree=4, num_gpus=16, micro_batch_per_gpu=0.125)
    stage = stage_model(p)
    assert stage.num_layers == 2 and stage.tied_embeddings
    assert stage.num_params == 2 * MODEL.num_params_per_block + 4096 * 1024  # blocks + one V x h matrix (norm 'none')
    sp = stage_plan(p)
    assert (sp.num_gpus, sp.data_parallel_degree, sp.micro_batch_per_gpu) == (4, 2, 0.5)
    assert sp.pipeline_parallel_degree == 1 and sp.micro_batches_per_step == 1


def test_first_stage_holds_min_p_m_micro_batches_of_activations():
    p = plan(pipeline_parallel_degree=4, num_gpus=16, micro_batch_per_gpu=0.125)
    assert in_flight_micro_batches(p) == 4
    assert in_flight_micro_batches(p.replace(micro_batches_per_step=2)) == 2
    stage_bill, bill = memory_bill(stage_plan(p)), memory_bill(p)
    inputs = MemoryTerm.RECOMPUTE_INPUTS
    assert bill.terms["gpu"][inputs] == 4 * stage_bill.terms["gpu"][inputs]
    assert bill.terms["gpu"][MemoryTerm.AWM] == stage_bill.terms["gpu"][MemoryTerm.AWM]
    no_recompute = p.replace(recompute_interval=0)
    assert memory_bill(no_recompute).terms["gpu"][MemoryTerm.AWM] == 4 * memory_bill(stage_plan(no_recompute)).terms["gpu"][MemoryTerm.AWM]
    # Weights: a quarter of the blocks per stage, not the whole model.
    whole = p.replace(pipeline_parallel_degree=1, num_gpus=4, micro_batches_per_step=1, micro_batch_per_gpu=0.5)
    assert bill.terms["gpu"][MemoryTerm.PARAMS] < memory_bill(whole).terms["gpu"][MemoryTerm.PARAMS] / 2


def test_estimate_and_simulator_compose_the_same_step_from_their_stage():
    p = plan()
    for method in (estimate, predict):
        whole = method(p)
        stage = method(stage_plan(p))
        quiet = method(stage_plan(p).replace(num_gpus=2))
        phases = whole.phase_time_s
        expected = compose_step(p, (stage.phase_time_s["forward"], stage.phase_time_s["backward"],
                                    stage.phase_time_s["optimizer"]),
                                (quiet.phase_time_s["forward"], quiet.phase_time_s["backward"]))
        assert phases["forward"] == pytest.approx(expected.forward_s)
        assert phases["backward"] == pytest.approx(expected.backward_s)
        assert whole.iteration_time_s == pytest.approx(expected.forward_s + expected.backward_s + expected.optimizer_s)
    est, sim = estimate(p), predict(p)
    assert sim.iteration_time_s == pytest.approx(est.iteration_time_s, rel=0.35)  # same terms, different resolution
    assert sim.details["pipeline"]["bubble_fraction"] == 1 / 8


def test_gradients_are_reduced_once_per_step_in_data_parallel_and_every_micro_batch_in_zero3():
    single = dict(pipeline_parallel_degree=1, model_parallel_degree=1, micro_batch_per_gpu=1)
    for method in (estimate, predict):
        dp1 = method(plan(strategy="dp", micro_batches_per_step=1, **single)).link_bytes["reduce_scatter"]
        dp4 = method(plan(strategy="dp", micro_batches_per_step=4, **single)).link_bytes["reduce_scatter"]
        z1 = method(plan(strategy="zero3", micro_batches_per_step=1, **single)).link_bytes["reduce_scatter"]
        z4 = method(plan(strategy="zero3", micro_batches_per_step=4, **single)).link_bytes["reduce_scatter"]
        assert dp1 > 0 and dp4 == dp1
        assert z4 == pytest.approx(4 * z1, rel=1e-6)


def test_tensor_parallel_all_reduces_are_on_the_critical_path_in_both():
    # 2 all-reduces per block forward, 2 in the recompute, 2 backward, of b s h bf16 activations,
    # each GPU moving 2 (tp - 1) / tp of them over NVLink; nothing else in the plan (one GPU pair, dp 1).
    node = NODE.replace(gpu_flops_per_s=1e18)  # compute negligible: the all-reduces are the time
    model = MODEL.replace(vocab_size=0)
    p = Plan(model=model, node=node, num_gpus=2, strategy="dp", model_parallel_degree=2, micro_batch_per_gpu=0.5,
             recompute_interval=1)
    # Each all-reduce also pays NCCL's ring latency: base 8.4 us + 2 (tp - 1) = 2 NVLink steps of 3.4 us.
    per_all_reduce_bytes = 2 * (2 - 1) / 2 * 1 * 512 * 1024 * 2
    per_all_reduce_s = per_all_reduce_bytes / (100 * GB) + 15.2e-6
    est = estimate(p)
    assert est.component_time_s["tensor parallel"] == pytest.approx(6 * 8 * per_all_reduce_s)
    sim = predict(p)
    assert sim.details["tensor_parallel_bytes"] == 6 * 8 * per_all_reduce_bytes
    assert sim.phase_time_s["forward"] >= 2 * 8 * per_all_reduce_s


def test_cross_node_collectives_are_hierarchical_rings_with_nccl_latency_in_both():
    # 8 GPUs on two 4-GPU nodes, tp 1: one data-parallel ring crossing each node once, so the node's
    # whole network (40 GB/s, below NVLink's 100) carries it; each of the 8 x 4 operators' all-gathers
    # per pass pays base 8.4 us + 6 NVLink steps x 3.4 us + 1 network step x 14 us = 42.8 us.
    node = NODE.replace(gpu_flops_per_s=1e18)
    p = Plan(model=MODEL.replace(vocab_size=0), node=node, num_gpus=8, strategy="zero3", micro_batch_per_gpu=1,
             recompute_interval=0, prefetch_depth=0)
    est, sim = estimate(p), predict(p)
    gathered = est.link_bytes["all_gather"]
    assert sim.link_bytes["all_gather"] == pytest.approx(gathered, rel=1e-9)
    assert est.component_time_s["params (gpu)"] == pytest.approx(gathered / (40 * GB) + 2 * 32 * 42.8e-6)
    # The port also carries the reduce-scatters (half the gathers' bytes: one pass to the gathers' two).
    reduced = est.link_bytes["reduce_scatter"]
    assert sim.details["resources"]["inter_node"]["busy_s"] == pytest.approx((gathered + reduced) / (40 * GB), rel=1e-9)


def test_fp8_runs_the_linears_at_the_datasheet_ratio():
    # A spec that states no sustained fp8 rate runs its linears at the datasheet's fp8 / bf16 ratio; the
    # fitted H100 presets state one (tests/test_validation_fit.py checks that ratio).
    h100 = hardware_presets()["dgx-h100"].replace(fp8_matmul_flops_per_s=0.0)
    assert fp8_speedup(h100) == pytest.approx(1979 / 989)
    assert fp8_speedup(h100.replace(name="dgx-h100 (94 GB part)")) == pytest.approx(1979 / 989)
    big = ModelSpec(name="wide", num_layers=4, hidden_size=8192, num_heads=64, seq_len=2048)
    base = Plan(model=big, node=h100, num_gpus=1, strategy="dp", micro_batch_per_gpu=1, recompute_interval=0)
    fp8 = base.replace(fp8_matmuls=True)
    # The estimate: the linears' seconds at the fp8 rate (no head here: vocab 0), the fused attention and
    # memory-bound kernels not, plus the casts' bytes at the achievable HBM bandwidth (planner/cost/fp8.py).
    work = model_compute(base)
    matmul_s = (work.forward_flops + work.backward_flops) / h100.gpu_flops_per_s
    casts_s = 4 * sum(cast_bytes(fp8)) / achievable_hbm_bytes_per_s(h100)
    assert estimate(fp8).component_time_s["compute"] == pytest.approx(
        estimate(base).component_time_s["compute"] - matmul_s * (1 - 989 / 1979) + casts_s)
    bf16_busy = predict(base).details["resources"]["gpu_compute"]["busy_s"]
    fp8_busy = predict(fp8).details["resources"]["gpu_compute"]["busy_s"]
    # The linears halve; the attention core and the memory-bound kernels stay bf16.
    assert bf16_busy * 989 / 1979 < fp8_busy < bf16_busy
    with pytest.raises(PlannerError, match="dgx2-v100.*no fp8 matmul rate"):
        check_plan(base.replace(node=hardware_presets()["dgx2-v100"], fp8_matmuls=True))


@pytest.mark.parametrize("changes, fragment", [
    (dict(pipeline_parallel_degree=3), "does not divide num_gpus 8"),
    (dict(strategy="zero-inf-cpu", placement=STRATEGY_TABLE["zero-inf-cpu"].placement), "pipelines no offload"),
    (dict(num_gpus=24, pipeline_parallel_degree=4, micro_batch_per_gpu=1 / 8), "not whole 4-GPU nodes"),
    (dict(pipeline_parallel_degree=1, pipeline_virtual_stages=2, micro_batch_per_gpu=0.5), "needs pipeline_parallel_degree > 1"),
    (dict(optimizer_step="in_backward"), "cannot accumulate 8 micro-batches"),
    (dict(pipeline_parallel_degree=9, num_gpus=18), "pipeline_parallel_degree"),
])
def test_bad_pipeline_plans_are_refused_in_one_line(changes, fragment):
    with pytest.raises(PlannerError, match=fragment):
        plan(**changes)


def test_plan_documents_round_trip_and_old_documents_load():
    p = plan(pipeline_virtual_stages=2)
    doc = p.to_dict()
    assert (doc["pipeline_parallel_degree"], doc["pipeline_virtual_stages"], doc["micro_batches_per_step"],
            doc["fp8_matmuls"]) == (2, 2, 8, False)
    assert Plan.from_dict(json.loads(json.dumps(doc))) == p
    old = {k: v for k, v in plan(pipeline_parallel_degree=1, micro_batches_per_step=1, micro_batch_per_gpu=0.5,
                                 strategy="dp").to_dict().items()
           if k not in ("pipeline_parallel_degree", "pipeline_virtual_stages", "micro_batches_per_step", "fp8_matmuls")}
    loaded = Plan.from_dict(old)
    assert (loaded.pipeline_parallel_degree, loaded.micro_batches_per_step, loaded.fp8_matmuls) == (1, 1, False)
    assert loaded.tokens_per_iteration == 0.5 * 8 * 512


def test_3d_is_megatrons_zero1_on_the_gpus():
    s = STRATEGY_TABLE["3d"]
    assert s.placement == Placement() and s.partitioned == frozenset({"optimizer_states"})


def test_link_bytes_per_step_count_the_optimizer_once_and_each_micro_batch_once():
    # 3d (ZeRO-1) on 2 stages: the reduce-scatter once per step, the parameter all-gather after the
    # step once; nothing negative where the quiet micro-batches have no optimizer traffic of their own.
    p = plan()
    one = plan(micro_batches_per_step=1)
    for method in (estimate, predict):
        links = method(p).link_bytes
        assert all(v >= 0 for v in links.values())
        assert links["all_gather"] == method(one).link_bytes["all_gather"] > 0
        assert links["reduce_scatter"] == method(one).link_bytes["reduce_scatter"] > 0


def test_validation_rows_keep_their_stated_layout():
    import dataclasses

    from planner.validation.configure import row_plan
    from planner.validation.corpus import load_corpus

    rows = {r.row_id: r for r in load_corpus()}
    # NeMo 24.07 GPT3-175B: TP 4, PP 8, VP 6 (in the note), micro 1, global 256 on 128 H100s, FP8.
    nemo = row_plan(dataclasses.replace(rows["p224"], activation_recompute="full", sharding="zero1")).plan
    assert (nemo.model_parallel_degree, nemo.pipeline_parallel_degree, nemo.pipeline_virtual_stages) == (4, 8, 6)
    assert (nemo.data_parallel_degree, nemo.micro_batches_per_step, nemo.micro_batch_per_gpu) == (4, 64, 1 / 32)
    assert nemo.fp8_matmuls and nemo.precision == "bf16" and nemo.strategy == "3d"
    # As the corpus has it, p224 keeps its stated layout; what it does not state is searched
    # (planner/validation/unstated.py), never the pipeline.
    searched = row_plan(rows["p224"])
    assert (searched.plan.model_parallel_degree, searched.plan.pipeline_parallel_degree) == (4, 8)
    assert searched.plan.micro_batches_per_step == 64 and not searched.reasons
    assert any(a.startswith("searched activation_recompute") for a in searched.assumptions)
    # Narayanan Table 1 states no micro-batch: the search picks one that divides the global batch.
    table1 = row_plan(rows["p016"]).plan
    micro = round(table1.micro_batch_per_gpu * table1.gpus_per_replica)
    assert table1.micro_batches_per_step * micro * 32 == 1792
    megatron = row_plan(dataclasses.replace(rows["p016"], micro_batch=1)).plan
    assert (megatron.pipeline_parallel_degree, megatron.micro_batches_per_step) == (4, 1792 // 32)
