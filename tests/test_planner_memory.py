"""The memory model reproduces the paper's equations to the byte and names every runtime buffer."""

import pytest

from planner.cost.memory import memory_bill, min_tiling_factor, paper_quantities
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.memory_terms import MemoryTerm
from planner.specs.plan import STRATEGY_TABLE, Placement, Plan
from planner.specs.units import GIB


def plan_for(model="1T", hardware="dgx2-v100", gpus=16, strategy="zero3", **kw):
    return Plan(model=resolve_model(model), node=resolve_hardware(hardware), num_gpus=gpus, strategy=strategy,
                placement=STRATEGY_TABLE[strategy].placement if strategy != "custom" else kw.pop("placement"), **kw)


# Hand-computed from docs/method.md §2 with nl=128, hd=25600, heads=256, seq=1024, bsz=1, ci=1:
#   eq. 2: 240 * 128 * 25600^2                      = 20_132_659_200_000  (18.31 TiB, the paper's Table 1)
#   eq. 3: 2 * 1 * 1024 * 25600 * 128 / 1            = 6_710_886_400
#   eq. 4: 16 * 25600^2                              = 10_485_760_000
#   eq. 5: 1 * 1024 * 1 * (16 * 25600 + 2 * 256 * 1024) = 956_301_312
def test_paper_equations_1t():
    q = paper_quantities(plan_for())
    assert q["model_states"] == 20_132_659_200_000
    assert round(q["model_states"] / 1024**4, 2) == 18.31
    assert q["recompute_inputs_per_gpu"] == 6_710_886_400
    assert q["mswm_per_gpu"] == 10_485_760_000
    assert q["awm_per_gpu"] == 956_301_312
    assert q["activations_per_gpu"] == 6_710_886_400 + 956_301_312


# Same equations for the other memory-requirement configurations, batch 8 and ci 2 (hand-computed):
#   0.1T (80, 10240, 128):  eq.2 240*80*10240^2 = 2_013_265_920_000; eq.3 2*8*1024*10240*40 = 6_710_886_400
#                           eq.4 16*10240^2 = 1_677_721_600; eq.5 8*1024*2*(163840 + 262144) = 6_979_321_856
#   10T (195, 65536, 512):  eq.2 240*195*65536^2 = 201_004_469_452_800; eq.3 2*8*1024*65536*98 = 105_226_698_752
#                           eq.4 16*65536^2 = 68_719_476_736; eq.5 8*1024*2*(1048576 + 1048576) = 34_359_738_368
@pytest.mark.parametrize(
    "model,expected",
    [
        ("0.1T", (2_013_265_920_000, 6_710_886_400, 1_677_721_600, 6_979_321_856)),
        ("10T", (201_004_469_452_800, 105_226_698_752, 68_719_476_736, 34_359_738_368)),
    ],
)
def test_paper_equations_batch_and_interval(model, expected):
    q = paper_quantities(plan_for(model, micro_batch_per_gpu=8, recompute_interval=2))
    assert (q["model_states"], q["recompute_inputs_per_gpu"], q["mswm_per_gpu"], q["awm_per_gpu"]) == expected


def test_zero3_partitions_model_states_across_gpus():
    bill = memory_bill(plan_for())
    # Eq. 2's 20 bytes/param / 16 GPUs as the runtime holds them: 2 (bf16 params) + 16 (fp32 gradient
    # copy, master, momentum, variance); no 16-bit gradient shard exists ([Note: runtime bytes per parameter]).
    params = 12 * 128 * 25600**2
    assert bill.terms["gpu"]["params"] == params * 2 // 16
    assert "gradients" not in bill.terms["gpu"]
    assert bill.terms["gpu"]["optimizer_states"] == params * 16 // 16
    assert not bill.fits and "GPU needs" in bill.reason()


def test_offloaded_states_are_billed_per_node():
    bill = memory_bill(plan_for(strategy="zero-inf-nvme", micro_batch_per_gpu=7))
    params = 12 * 128 * 25600**2
    assert bill.terms["nvme"]["optimizer_states"] == params * 16 // 16 * 16  # per GPU x 16 GPUs
    assert bill.terms["nvme"]["params"] == params * 2
    assert bill.terms["cpu"]["recompute_inputs"] == 2 * 7 * 1024 * 25600 * 128 * 16
    assert "params" not in bill.terms["gpu"]
    # buffers the runtime holds for NVMe traffic are named terms
    for term in ("param_swap_buffers", "optimizer_swap_buffers", "gradient_swap_buffers"):
        assert bill.terms["cpu"][term] > 0
    for term in ("awm", "mswm", "prefetch_gathered_params", "reduce_scatter_buffer",
                 "gradient_offload_staging", "recompute_input_offload_staging", "allocator_slack"):
        assert bill.terms["gpu"][term] > 0
    # Shards read ahead from NVMe (i+2, i+3 at depth 3) wait in host swap buffers, not on the GPU.
    assert "prefetch_shard_staging" not in bill.terms["gpu"]
    # Reads to the GPU land in pinned slots, one for the operator in use and each of the three ahead
    # (four shards of the gathered unit / 16 ranks, 4 KiB aligned) per GPU, 16 GPUs per node.
    assert bill.terms["cpu"]["param_swap_buffers"] == pytest.approx(
        4 * bill.terms["gpu"]["prefetch_gathered_params"] / 16 * 16, rel=1e-4)
    assert bill.fits, bill.reason()


def test_allocator_slack_is_ten_percent_of_transient_terms():
    gpu = memory_bill(plan_for(strategy="zero-inf-cpu")).terms["gpu"]
    transient = sum(v for k, v in gpu.items() if k.transient)
    assert set(gpu) - {k for k in gpu if k.transient} == {MemoryTerm.ALLOCATOR_SLACK}  # all states on the host
    assert gpu["allocator_slack"] == pytest.approx(0.1 * transient, abs=8)


def test_tiling_divides_operator_working_memory():
    one = memory_bill(plan_for(strategy="zero-inf-cpu")).terms["gpu"]
    four = memory_bill(plan_for(strategy="zero-inf-cpu", tiling_factor=4)).terms["gpu"]
    # The largest unit (weight + bias) is tiled; the tied embedding kept gathered is not (no
    # embeddings in the paper's models, so exactly a quarter).
    assert four["mswm"] == pytest.approx(one["mswm"] / 4, abs=1)
    assert four["prefetch_gathered_params"] == pytest.approx(one["prefetch_gathered_params"] / 4, abs=1)


def test_largest_allocation_drives_minimum_tiling():
    # Paper tiling study: GPU memory fragmented into 2 GB chunks. hd 64K: the hd x 4hd fp16 weight is
    # 4 * 65536^2 * 2 bytes = 32 GiB, so it needs 16 tiles; hd 8K (512 MiB) needs none.
    node = resolve_hardware("dgx2-v100").replace(gpu_max_alloc_bytes=2 * GIB)
    for hidden, tiles in ((8192, 1), (16384, 1), (32768, 4), (65536, 16)):
        model = resolve_model(None, layers=1, hidden=hidden, heads=hidden // 128)
        plan = Plan(model=model, node=node, num_gpus=16, strategy="zero-inf-cpu",
                    placement=STRATEGY_TABLE["zero-inf-cpu"].placement)
        assert min_tiling_factor(plan) == tiles
        if tiles > 1:
            assert "largest free block" in memory_bill(plan.replace(tiling_factor=tiles // 2)).reason()


def test_prefetch_depth_zero_holds_no_prefetch_buffers():
    gpu = memory_bill(plan_for(strategy="zero-inf-cpu", prefetch_depth=0)).terms["gpu"]
    assert "prefetch_gathered_params" not in gpu and "prefetch_shard_staging" not in gpu


def test_no_recompute_keeps_every_layer():
    plan = plan_for("paper-1.4b", gpus=1, hardware="h200-x1", recompute_interval=0)
    q = paper_quantities(plan)
    assert q["recompute_inputs_per_gpu"] == 0
    assert q["awm_per_gpu"] == 1024 * 40 * (16 * 1536 + 2 * 16 * 1024)


def test_embeddings_add_logits_buffer():
    plan = plan_for("gpt3-1.3b", gpus=8, hardware="dgx-h100", micro_batch_per_gpu=2)
    gpu = memory_bill(plan).terms["gpu"]
    assert gpu["logits"] == 2 * 2048 * 50257 * (2 + 4)


def test_data_parallel_replicates_everything():
    gpu = memory_bill(plan_for("paper-1.4b", hardware="dgx-h100", gpus=8, strategy="dp")).terms["gpu"]
    params = 12 * 40 * 1536**2
    # replicated, as the runtime holds them: bf16 params, fp32 gradient copy + master, momentum, variance
    assert (gpu["params"], gpu.get("gradients", 0), gpu["optimizer_states"]) == (2 * params, 0, 16 * params)


def test_custom_placement_validation():
    with pytest.raises(ValueError, match="gradients must be cpu"):
        Placement(optimizer_states="cpu", gradients="gpu")


def test_in_backward_host_updates_bill_their_gradient_staging():
    """The in-backward update of optimizer states on NVMe runs on the host: each unit's gradient
    shard is copied into one of IN_BACKWARD_STAGED_GRADIENTS pinned buffers (the worker's update and
    the one being filled, runtime/optim/optimizer_worker.py), billed as gradient_swap_buffers."""
    from planner.cost.memory import IN_BACKWARD_STAGED_GRADIENTS, largest_unit_params

    nvme = Placement(params="nvme", gradients="nvme", optimizer_states="nvme", recompute_inputs="cpu")
    p = plan_for(model="0.1T", strategy="custom", placement=nvme, optimizer_step="in_backward", precision="bf16")
    shard = largest_unit_params(p) / p.data_parallel_degree
    per_gpu = IN_BACKWARD_STAGED_GRADIENTS * -(-int(shard * 2) // 4096) * 4096
    assert IN_BACKWARD_STAGED_GRADIENTS == 2
    billed = memory_bill(p).terms["cpu"][MemoryTerm.GRADIENT_SWAP_BUFFERS]  # the node's: every GPU's buffers
    assert billed == pytest.approx(per_gpu * p.cluster.gpus_per_node, abs=4096 * 16)
    # After backward the gradients are stored on NVMe through their own write buffers, not staged.
    after = p.replace(optimizer_step="after_backward")
    assert memory_bill(after).terms["cpu"][MemoryTerm.GRADIENT_SWAP_BUFFERS] != memory_bill(p).terms["cpu"][
        MemoryTerm.GRADIENT_SWAP_BUFFERS]


def test_host_pinning_is_a_plan_key_that_old_plans_read_as_staged():
    """`host_pinning` (planner.specs.plan.HostPinning): a plan written before it existed loads as
    `staged`, a staged plan is written without it (old readers see the same document), `shards`
    is written and read back, anything else is refused in one line naming the value."""
    from planner.specs.errors import PlannerError
    from planner.specs.plan import HostPinning

    old = plan_for(strategy="zero-inf-cpu").to_dict()
    assert "host_pinning" not in old
    assert Plan.from_dict(old).host_pinning is HostPinning.STAGED
    pinned = Plan.from_dict({**old, "host_pinning": "shards"})
    assert pinned.host_pinning is HostPinning.SHARDS and pinned.to_dict()["host_pinning"] == "shards"
    assert Plan.from_dict(pinned.to_dict()) == pinned
    with pytest.raises(PlannerError, match="host_pinning must be one of shards, staged, got 'locked'"):
        Plan.from_dict({**old, "host_pinning": "locked"})


def test_pinned_shards_bill_the_gradients_landing_and_no_pool_for_them():
    """With `host_pinning: shards` the host shards cross the link from pinned memory of their own:
    the gradients land in buffers the size of their compute-precision shard, billed per node; the
    staging pool remains only for fp32 masters written back to device parameters."""
    all_cpu = Placement(params="cpu", gradients="cpu", optimizer_states="cpu", recompute_inputs="cpu")
    kw = {"model": "gpt3-1.3b", "hardware": "dgx-h100", "gpus": 8, "strategy": "custom"}
    staged, shards = (memory_bill(plan_for(placement=all_cpu, host_pinning=p, **kw)).terms["cpu"]
                      for p in ("staged", "shards"))
    assert MemoryTerm.PINNED_STAGING_POOL in staged and MemoryTerm.GRADIENT_LANDING_BUFFERS not in staged
    assert MemoryTerm.PINNED_STAGING_POOL not in shards
    assert shards[MemoryTerm.GRADIENT_LANDING_BUFFERS] == staged[MemoryTerm.PARAMS]  # bf16 either way, per node
    offload = Placement(params="gpu", gradients="cpu", optimizer_states="cpu", recompute_inputs="gpu")
    masters_back = memory_bill(plan_for(placement=offload, host_pinning="shards", **kw)).terms["cpu"]
    assert MemoryTerm.PINNED_STAGING_POOL in masters_back and MemoryTerm.GRADIENT_LANDING_BUFFERS in masters_back


def test_batch_bills_are_memory_bills_term_by_term_in_order():
    # BatchBills works out the terms that do not depend on the batch once (the search sizes every
    # candidate's batch from several bills): each of its bills must be memory_bill's, the terms in
    # the same order, for every kind of placement, pinning, schedule, precision and hardware.
    from planner.cost.memory import BatchBills
    from planner.search.search import candidate_placements
    from planner.specs.plan import HostPinning

    for model, hardware, gpus in (("1T", "dgx-h100", 16), ("qwen2.5-7b", "dgx-a100-80g", 8), ("1.4B", "h200-x1", 1),
                                  ("13b", "cpu-dev-2core", 1), ("7B", "rtx4090-workstation", 1)):
        for strategy, placement in candidate_placements(None, {}):
            for pinning, step, tiling, depth, ci in ((HostPinning.STAGED, "after_backward", 1, 3, 1),
                                                      (HostPinning.SHARDS, "in_backward", 4, 0, 0),
                                                      (HostPinning.STAGED, "in_backward", 2, 2, 2)):
                plan = Plan(model=resolve_model(model), node=resolve_hardware(hardware), num_gpus=gpus,
                            strategy=strategy, placement=placement, micro_batch_per_gpu=1, recompute_interval=ci,
                            tiling_factor=tiling, prefetch_depth=depth, host_pinning=pinning, optimizer_step=step,
                            precision="fp32" if hardware == "cpu-dev-2core" else "bf16")
                bills = BatchBills(plan)
                for batch in (1, 2, 7):
                    sized, bill = bills.at(batch)
                    alone = memory_bill(plan.replace(micro_batch_per_gpu=batch))
                    assert sized == plan.replace(micro_batch_per_gpu=batch)
                    assert bill == alone
                    assert [list(t.items()) for t in bill.terms.values()] == [list(t.items()) for t in alone.terms.values()]
