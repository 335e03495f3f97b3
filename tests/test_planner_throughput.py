"""Analytic estimate (paper §4) on hand-computable cases."""

import pytest

from planner.cost.throughput import bandwidths, efficiency, estimate
from planner.specs.hardware import NodeSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import STRATEGY_TABLE, Plan
from planner.specs.tiers import NVME
from planner.specs.units import GB, GIB

# A round-number node: 1 TFLOP/s GPUs, 10 GB/s host links, NVMe 4 GB/s per node, 100 GB/s NVLink; a
# host thread copies at 100 GB/s, so the staged copies and gradient landings below run at the links' rates.
NODE = NodeSpec(
    name="round",
    num_gpus_per_node=4,
    gpu_memory_bytes=64 * GIB,
    gpu_flops_per_s=1e12,
    gpu_hbm_bytes_per_s=1000 * GB,
    cpu_memory_bytes=512 * GIB,
    nvme_capacity_bytes=4096 * GIB,
    host_to_gpu_bytes_per_s=10 * GB,
    gpu_to_host_bytes_per_s=10 * GB,
    host_memory_bytes_per_s=40 * GB,
    nvme_read_bytes_per_s=4 * GB,
    nvme_write_bytes_per_s=2 * GB,
    gpu_gpu_intra_node_bytes_per_s=100 * GB,
    cpu_adam_params_per_s=1e9,
    host_memcpy_bytes_per_s=100 * GB,
)
MODEL = ModelSpec(num_layers=1, hidden_size=1024, num_heads=8)  # P = 12 * 1024^2 = 12_582_912
P = 12 * 1024**2
# One block at bsz 1, seq 1024 = hd, eager attention (the round node has no flash kernel), bf16:
# matmuls 2 x tokens x P plus QK^T and AV over the whole square (4 seq^2 hd); memory-bound kernels
# (planner/cost/kernels.py) forward: norms 2 x 2 x 2, residual 2 x 3 x 2, GeLU 2 x 2 x 4hd -> 36 hd bytes
# per token, softmax 2 x 2 x heads x seq = 32 seq; backward 12 + 12 + 24 = 48 hd and 3 x 2 x 8 = 48 seq.
# With full recompute the backward runs the forward again.
FWD_FLOPS = 2 * 1024 * P + 4 * 1024**3
FWD_BYTES = (36 + 32) * 1024**2
BWD_FLOPS = 2 * FWD_FLOPS + FWD_FLOPS
BWD_BYTES = (48 + 48) * 1024**2 + FWD_BYTES
KERNEL_BYTES_PER_S = 0.83 * 1000 * GB  # HBM x the achievable fraction
COMPUTE_FWD = FWD_FLOPS / 1e12 + FWD_BYTES / KERNEL_BYTES_PER_S
COMPUTE_BWD = BWD_FLOPS / 1e12 + BWD_BYTES / KERNEL_BYTES_PER_S


def plan(strategy, gpus=4, **kw):
    return Plan(model=MODEL, node=NODE, num_gpus=gpus, strategy=strategy, placement=STRATEGY_TABLE[strategy].placement, **kw)


def test_per_gpu_bandwidths_share_the_node_aggregates():
    bw = bandwidths(plan("zero-inf-nvme"))
    assert bw.h2d == 10 * GB  # 40 GB/s node aggregate / 4 GPUs = 10, equal to the link
    assert bw.reads[NVME] == 1 * GB  # 4 GB/s / 4 GPUs
    assert bw.writes[NVME] == 0.5 * GB
    assert bw.all_gather == 100 * GB


def test_zero_inf_cpu_serial_iteration():
    # depth 0: nothing overlaps. bsz 1, seq 1024, ci 1, bf16, 4 GPUs (dp 4).
    est = estimate(plan("zero-inf-cpu", prefetch_depth=0))
    param_bytes = 2 * P
    per_pass = max(param_bytes * 3 / 4 / (100 * GB), param_bytes / 4 / (10 * GB))  # all-gather vs own shard
    grads = max(2 * P * 3 / 4 / (100 * GB), 2 * P / 4 / (10 * GB))
    inputs = 2 * 1024 * 1024 * 1  # eq. 3: one recompute input of one block
    inputs_s = inputs / (10 * GB) + inputs / (10 * GB)
    # CPU Adam over the node's 4 shards, each update's cast of the master into the bf16 parameter shard
    # beside it: 4 + 2 bytes/param at the 40 GB/s host memory (planner/cost/host_work.py [Note: the
    # resident step's cast]).
    optimizer = P / 4 * 4 / 1e9 * (1 + 6 * 1e9 / (40 * GB))
    assert est.phase_time_s["forward"] == pytest.approx(COMPUTE_FWD + per_pass + inputs / (10 * GB))
    assert est.phase_time_s["backward"] == pytest.approx(COMPUTE_BWD + 2 * per_pass + grads + inputs / (10 * GB))
    assert est.phase_time_s["optimizer"] == pytest.approx(optimizer)
    assert est.iteration_time_s == pytest.approx(COMPUTE_FWD + COMPUTE_BWD + 3 * per_pass + grads + inputs_s + optimizer)
    assert est.tflops_per_gpu == pytest.approx(8 * 1024 * P / est.iteration_time_s / 1e12)
    assert est.link_bytes["h2d"] == int(3 * param_bytes / 4 + inputs)


def test_overlap_takes_the_max_instead_of_the_sum():
    serial = estimate(plan("zero-inf-cpu", prefetch_depth=0))
    overlapped = estimate(plan("zero-inf-cpu", prefetch_depth=3))
    assert overlapped.phase_time_s["forward"] == pytest.approx(COMPUTE_FWD)  # compute-bound here
    assert overlapped.iteration_time_s < serial.iteration_time_s


def test_bandwidth_centric_partitioning_scales_with_gpus():
    # Params on NVMe: each GPU reads 1/dp of each parameter over its share of the node's NVMe (1 of
    # 4 GB/s here: one GPU of the 4-GPU node is billed a quarter of the node, [Note: part of a node]),
    # so the fetch time per pass falls as 1/dp: the aggregate bandwidth grows with the GPUs.
    one = estimate(plan("zero-inf-nvme", gpus=1, micro_batch_per_gpu=1)).component_time_s["params (nvme)"]
    four = estimate(plan("zero-inf-nvme", gpus=4, micro_batch_per_gpu=1)).component_time_s["params (nvme)"]
    assert one == pytest.approx(3 * 2 * P / (1 * GB))
    assert four == pytest.approx(3 * max(2 * P / 4 / (1 * GB), 2 * P * 3 / 4 / (100 * GB)))
    assert four == pytest.approx(one / 4)


def test_nvme_optimizer_reads_and_writes_every_state_byte():
    est = estimate(plan("zero-inf-nvme"))
    shard = P / 4
    # The runtime's streamed step reads master, momentum, variance and the fp32 gradient (16 B/param,
    # eq. 10) and writes back the 12 B of fp32 state plus the bf16 parameters.
    io = shard * 16 / (1 * GB) + shard * 12 / (0.5 * GB) + shard * 2 / (0.5 * GB)
    assert est.phase_time_s["optimizer"] == pytest.approx(max(P / 1e9, io))
    # Backward writes the fp32 gradient shard the step reads back (bf16 gradients are added into it).
    assert est.link_bytes["nvme_write"] == int(shard * 12 + shard * 2 + 4 * P / 4)


def test_eq6_efficiency():
    # Paper §4.2: ait 1024 at 3 GB/s against a 70 TFLOP/s peak gives 4.2% efficiency.
    assert efficiency(1024, 3e9, 70e12) == pytest.approx(1024 * 3e9 / (1024 * 3e9 + 70e12))
    assert round(efficiency(1024, 3e9, 70e12), 3) == 0.042


@pytest.mark.parametrize("recompute_interval", [0, 1])
def test_a_backward_matmul_rate_of_its_own_times_the_backward_matmuls_alone(recompute_interval):
    # [Note: the backward's own matmul rate] in planner/calibration/calibrate.py: at half the forward's rate the
    # backward's own matmuls (2 x FWD_FLOPS here) take twice as long, in the estimate and in the
    # simulator alike; the forward and the recompute's forward keep the forward's rate.
    from planner.sim.report import simulate

    def one_gpu(node):
        return Plan(model=MODEL, node=node, num_gpus=1, strategy="dp", placement=STRATEGY_TABLE["dp"].placement,
                    recompute_interval=recompute_interval, prefetch_depth=0)

    same, slow = one_gpu(NODE), one_gpu(NODE.replace(backward_matmul_flops_per_s=0.5e12))
    assert NODE.backward_matmul_rate == 1e12 and slow.node.backward_matmul_rate == 0.5e12
    extra_s = 2 * FWD_FLOPS / 1e12
    for predict in (lambda p: estimate(p).phase_time_s, lambda p: simulate(p).prediction.phase_time_s):
        before, after = predict(same), predict(slow)
        assert after["forward"] == pytest.approx(before["forward"], rel=1e-9)
        assert after["backward"] - before["backward"] == pytest.approx(extra_s, rel=1e-6)
    assert NodeSpec.from_dict(slow.node.to_dict()).backward_matmul_flops_per_s == 0.5e12
    assert "backward_matmul_tflops" not in NODE.to_dict()  # unset: documents of other nodes stay as they were
