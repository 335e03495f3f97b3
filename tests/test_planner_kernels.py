"""Per-block compute and memory terms (planner/cost/kernels.py): hand-computed bytes and flops, the plan
fields that choose them, the memory bill under each attention kernel, and the analytic estimate and
the simulator timing them alike."""

import pytest

from planner.cost.kernels import (
    HBM_ACHIEVABLE_FRACTION,
    attention_flops,
    block_cost,
    kernel_bytes,
    loss_bytes,
    score_products_memory_bound_share,
)
from planner.cost.memory import activation_working_bytes, memory_bill, paper_quantities
from planner.cost.throughput import estimate
from planner.sim.report import simulate
from planner.specs.catalog import hardware_presets, resolve_model
from planner.specs.errors import PlannerError
from planner.specs.hardware import NodeSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.units import GB, GIB, TFLOP

# hd 1024, 8 heads, seq 2048, ffn 4096: round numbers for every formula below.
GPT = ModelSpec(name="gpt", num_layers=2, hidden_size=1024, num_heads=8, seq_len=2048)
LLAMA = ModelSpec(name="llama", num_layers=2, hidden_size=1024, num_heads=8, num_kv_heads=2, seq_len=2048,
                  ffn_hidden_size=2816, gated_mlp=True, rotary=True, tied_embeddings=False, vocab_size=32000)


def node(**overrides) -> NodeSpec:
    """A one-GPU node without efficiency curves: every rate is its peak, so both methods agree exactly."""
    base = dict(name="flat", num_gpus_per_node=1, gpu_memory_bytes=80 * GIB, gpu_flops_per_s=100 * TFLOP,
                gpu_hbm_bytes_per_s=1000 * GB, cpu_memory_bytes=512 * GIB, host_to_gpu_bytes_per_s=20 * GB,
                gpu_to_host_bytes_per_s=20 * GB, host_memory_bytes_per_s=40 * GB, cpu_adam_params_per_s=1e9,
                flash_attention_flops_per_s=50 * TFLOP)
    base.update(overrides)
    return NodeSpec(**base)


def plan(model=GPT, **kw) -> Plan:
    kw.setdefault("node", node())
    return Plan(model=model, num_gpus=kw.pop("num_gpus", 1), strategy="dp", **kw)


def test_gpt_block_kernel_bytes_eager_and_flash():
    tokens, hd, e = 2048, 1024, 2
    fwd, bwd = kernel_bytes(plan(attention="eager"))
    assert fwd == {"norms": 2 * 2 * e * tokens * hd, "residual": 2 * 3 * e * tokens * hd,
                   "activation": 2 * e * tokens * 4 * hd, "softmax": 2 * e * tokens * 8 * 2048}
    assert bwd == {"norms": 2 * 3 * e * tokens * hd, "residual": 2 * 3 * e * tokens * hd,
                   "activation": 3 * e * tokens * 4 * hd, "softmax": 3 * e * tokens * 8 * 2048}
    flash_fwd, flash_bwd = kernel_bytes(plan(attention="flash"))
    assert "softmax" not in flash_fwd and "softmax" not in flash_bwd  # fused into the attention kernel
    assert sum(flash_fwd.values()) == 36 * tokens * hd  # 8 + 12 + 16 bytes per token per hd


def test_eager_products_charge_the_score_traffic_their_flops_do_not_cover():
    # [Note: eager products on the roofline]: GPT's head_dim 128 in 2 bytes is 128 flops per byte.
    e, scores = 2, 2048 * 8 * 2048  # 2-byte elements; one sample's 8 heads of 2048 x 2048 scores
    # 100 TFLOPS over 0.83 x 1000 GB/s: ridge 120 flops per byte, below 128: compute-bound, nothing charged.
    assert score_products_memory_bound_share(plan(attention="eager")) == 0.0
    assert "score_products" not in kernel_bytes(plan(attention="eager"))[0]
    # 400 TFLOPS over 0.5 x 1000 GB/s (ridge 800): u = 1 - 128 x 500e9 / 400e12 = 0.84 of the bytes.
    fast = node(gpu_flops_per_s=400 * TFLOP, hbm_achievable_fraction=0.5)
    u = 1 - 128 * 500e9 / 400e12
    assert score_products_memory_bound_share(plan(node=fast, attention="eager")) == pytest.approx(u)
    fwd, bwd = kernel_bytes(plan(node=fast, attention="eager"))
    assert fwd["score_products"] == pytest.approx(2 * e * scores * u)  # QK^T writes S, P V reads P
    assert bwd["score_products"] == pytest.approx(4 * e * scores * u)  # dP written, P read, dS read twice
    _, selective = kernel_bytes(plan(node=fast, attention="eager", recompute="selective", recompute_interval=0))
    assert selective["score_products"] == pytest.approx(6 * e * scores * u)  # the forward's two passes again
    assert "score_products" not in kernel_bytes(plan(node=fast, attention="flash"))[1]  # flash keeps them on chip
    # The time follows: the simulator and the estimate charge the bytes at the achievable bandwidth.
    slow, quick = estimate(plan(node=fast, attention="eager")), estimate(plan(node=fast.replace(hbm_achievable_fraction=0.92), attention="eager"))
    assert slow.phase_time_s["forward"] > quick.phase_time_s["forward"]


def test_the_presets_eager_products_are_memory_bound_on_a100_and_not_on_the_papers_v100():
    presets = hardware_presets()
    gpt = ModelSpec(name="gpt3-1.3b", num_layers=24, hidden_size=2048, num_heads=16, seq_len=8192)
    a100 = Plan(model=gpt, node=presets["dgx-a100-80g"], num_gpus=1, strategy="dp", attention="eager")
    assert 0.2 < score_products_memory_bound_share(a100) < 0.6
    paper = Plan(model=resolve_model("1T"), node=presets["dgx2-v100"], num_gpus=16)
    assert paper.attention == "eager" and score_products_memory_bound_share(paper) == 0.0


def test_swiglu_rotary_dropout_and_tensor_parallel_bytes():
    tokens, e = 2048, 2
    fwd, bwd = kernel_bytes(plan(LLAMA, attention="flash"))
    assert (fwd["activation"], bwd["activation"]) == (3 * e * tokens * 2816, 5 * e * tokens * 2816)
    assert fwd["rotary"] == bwd["rotary"] == 2 * e * tokens * (1024 + 256)  # queries and the 2 kv heads' keys
    dropped, _ = kernel_bytes(plan(GPT.replace(dropout=True), attention="eager"))
    assert dropped["dropout"] == 2 * (2 * e + 1) * tokens * 1024
    assert dropped["attention_dropout"] == (2 * e + 1) * tokens * 8 * 2048
    # mp 2, replica micro-batch 2 (1 per GPU): the residual stream's kernels run on both ranks over the
    # replica's 2 x 2048 tokens, the ffn- and head-wide ones on half of it.
    big = node(num_gpus_per_node=2, gpu_gpu_intra_node_bytes_per_s=100 * GB)
    tp, _ = kernel_bytes(plan(num_gpus=2, node=big, model_parallel_degree=2, attention="eager"))
    assert tp["norms"] == 2 * 2 * e * (2 * tokens) * 1024
    assert tp["activation"] == 2 * e * tokens * 4096 and tp["softmax"] == 2 * e * tokens * 8 * 2048
    # Sequence parallelism: the residual stream's kernels run on half the replica's tokens per rank,
    # 2048 of them, like the ffn-wide ones; nothing else moves.
    sp, sp_bwd = kernel_bytes(plan(num_gpus=2, node=big, model_parallel_degree=2, attention="eager", sequence_parallel=True))
    assert sp["norms"] == 2 * 2 * e * tokens * 1024 and sp["residual"] == 2 * 3 * e * tokens * 1024
    assert sp_bwd["norms"] == 2 * 3 * e * tokens * 1024
    assert (sp["activation"], sp["softmax"]) == (tp["activation"], tp["softmax"])
    # One GPU, nothing to split: the flag changes no byte.
    assert kernel_bytes(plan(attention="eager", sequence_parallel=True)) == kernel_bytes(plan(attention="eager"))


def test_attention_flops_eager_flash_gqa_and_selective():
    square = 4 * 2048**2 * 1024  # QK^T and AV over the whole square, one sample
    assert attention_flops(plan(attention="eager")) == (square, 2 * square)
    assert attention_flops(plan(attention="flash")) == (square / 2, 2.5 * square / 2)  # causal half, recompute
    # Megatron's selective recompute runs the whole core forward (QK^T and P V) again in backward.
    assert attention_flops(plan(attention="eager", recompute="selective", recompute_interval=0)) == (square, 3 * square)
    assert attention_flops(plan(attention="flash", recompute="selective", recompute_interval=0)) == (square / 2, 1.25 * square)
    # GQA: the products are over the query width; the kv heads shrink only the qkv projection.
    assert attention_flops(plan(LLAMA, attention="eager"))[0] == square
    assert LLAMA.block_operators()[0].num_params == 1024 * (1024 + 2 * 256)
    assert [op.name for op in LLAMA.block_operators()] == ["qkv", "attn_out", "mlp_gate", "mlp_up", "mlp_down"]
    cost = block_cost(plan(LLAMA))
    assert cost.linear_flops == 2 * 2048 * (1024 * 1536 + 1024 * 1024 + 3 * 1024 * 2816)


def test_loss_moves_the_vocabulary_wide_logits():
    assert loss_bytes(plan(LLAMA)) == (2048 * 32000 * (2 + 8), 2048 * 32000 * (8 + 2))
    assert loss_bytes(plan(GPT)) == (0, 0)


def test_attention_defaults_to_flash_where_the_gpu_has_it():
    presets = hardware_presets()
    for name, kernel in (("dgx-h100", "flash"), ("dgx-a100-80g", "flash"), ("h200-x1", "flash"), ("dgx2-v100", "eager")):
        p = Plan(model=GPT, node=presets[name], num_gpus=1, strategy="dp")
        assert p.attention == kernel, name
    # The paper's presets pin eager: their memory bill is eq. 5 on any GPU.
    paper = Plan(model=resolve_model("1T"), node=presets["dgx-h100"], num_gpus=16)
    assert paper.attention == "eager"
    with pytest.raises(PlannerError, match="attention flash needs a GPU with a fused attention kernel"):
        Plan(model=GPT, node=presets["dgx2-v100"], num_gpus=1, attention="flash")
    with pytest.raises(PlannerError, match="attention must be one of flash, eager, got 'sdpa'"):
        plan(attention="sdpa")


def test_recompute_field_follows_recompute_interval():
    assert (plan().recompute, plan(recompute_interval=0).recompute) == ("full", "none")
    assert plan(recompute_interval=0, recompute="selective").replace(recompute_interval=1).recompute == "full"
    assert plan().replace(recompute_interval=0).recompute == "none"
    for kw in ({"recompute": "selective"}, {"recompute": "full", "recompute_interval": 0}):
        with pytest.raises(PlannerError, match="needs recompute_interval"):
            plan(**kw)
    doc = plan(recompute_interval=0, recompute="selective", attention="eager").to_dict()
    assert (doc["attention"], doc["recompute"]) == ("eager", "selective")
    assert Plan.from_dict(doc) == plan(recompute_interval=0, recompute="selective", attention="eager")


def test_flash_never_bills_the_scores_and_selective_holds_one_block():
    b_s, hd, heads, seq = 2048, 1024, 8, 2048
    eager = plan(attention="eager", recompute_interval=0)
    assert activation_working_bytes(eager) == b_s * 2 * (16 * hd + 2 * heads * seq)  # eq. 5, ci = nl
    assert activation_working_bytes(plan(attention="flash", recompute_interval=0)) == b_s * 2 * (16 * hd + 4 * heads)
    selective = plan(attention="eager", recompute_interval=0, recompute="selective")
    assert activation_working_bytes(selective) == b_s * 2 * 16 * hd + b_s * 2 * heads * seq
    # The paper quantity stays eq. 5 as written, whatever the kernel.
    assert paper_quantities(plan(attention="flash"))["awm_per_gpu"] == activation_working_bytes(plan(attention="eager"))
    assert memory_bill(plan(attention="flash")).terms["gpu"]["awm"] < memory_bill(plan(attention="eager")).terms["gpu"]["awm"]


@pytest.mark.parametrize("model, kw", [
    (GPT, {"attention": "eager"}),
    (GPT, {"attention": "flash"}),
    (GPT.replace(dropout=True), {"attention": "eager", "recompute_interval": 0, "recompute": "selective"}),
    (LLAMA, {"attention": "flash", "recompute_interval": 0}),
    (LLAMA, {"attention": "eager", "recompute_interval": 0, "recompute": "selective"}),
])
def test_analytic_estimate_and_simulator_time_the_same_block_terms(model, kw):
    # One GPU, everything on it, flat efficiency curves: forward and backward are pure compute in both.
    p = plan(model, **kw)
    est, sim = estimate(p), simulate(p).prediction
    for phase in ("forward", "backward"):
        assert sim.phase_time_s[phase] == pytest.approx(est.phase_time_s[phase], rel=1e-9), phase


def test_memory_bound_kernels_run_at_the_achievable_hbm_fraction():
    p = plan(attention="flash", recompute_interval=0)
    cost = block_cost(p)
    slow = p.replace(node=node(gpu_hbm_bytes_per_s=500 * GB))
    extra = 2 * (cost.forward_bytes + cost.backward_bytes) * (1 / (500 * GB) - 1 / (1000 * GB)) / HBM_ACHIEVABLE_FRACTION

    def passes(q):  # the optimizer step (GPU Adam) streams at the HBM rate too; compare the passes
        t = estimate(q).phase_time_s
        return t["forward"] + t["backward"]

    assert passes(slow) - passes(p) == pytest.approx(extra, rel=1e-9)


def test_the_fused_kernel_runs_at_its_rate_for_the_sequence_length():
    # [Note: the fused kernel's rate by sequence length]: the spec's attention curve, keyed by the
    # query length of one kernel call, scales the fused kernel's rate in the estimate and the
    # simulator alike; the matmuls and the memory-bound kernels do not move.
    from planner.cost.kernels import fused_attention_flops_per_s
    from planner.specs.hardware import EfficiencyCurve

    curve = EfficiencyCurve(((512.0, 0.4), (2048.0, 1.0)))
    p = plan(attention="flash", recompute_interval=0)
    slow = p.replace(node=node(attention_efficiency=curve), attention="flash")
    assert fused_attention_flops_per_s(p) == 50 * TFLOP
    assert fused_attention_flops_per_s(slow) == 50 * TFLOP  # seq 2048: the plateau
    at_1024 = slow.replace(model=GPT.replace(seq_len=1024))
    assert fused_attention_flops_per_s(at_1024) == pytest.approx(50 * TFLOP * 0.7)  # halfway in log(seq)
    flat_1024 = p.replace(model=GPT.replace(seq_len=1024))
    cost = block_cost(at_1024)
    extra = GPT.num_layers * (cost.fused_forward_flops + cost.fused_backward_flops) * (1 / (0.7 * 50 * TFLOP) - 1 / (50 * TFLOP))
    for method in (lambda q: estimate(q).phase_time_s, lambda q: simulate(q).prediction.phase_time_s):
        slow_t, flat_t = method(at_1024), method(flat_1024)
        assert slow_t["forward"] + slow_t["backward"] - flat_t["forward"] - flat_t["backward"] == pytest.approx(extra, rel=1e-9)
    # Ring attention's kernel calls cover seq / cp queries (planner/cost/context_parallel.py).
    assert fused_attention_flops_per_s(slow.replace(num_gpus=2, context_parallel_degree=2)) == pytest.approx(50 * TFLOP * 0.7)


def test_sequence_parallel_is_written_only_when_set_and_read_back():
    sp = plan(num_gpus=2, node=node(num_gpus_per_node=2, gpu_gpu_intra_node_bytes_per_s=100 * GB),
              model_parallel_degree=2, sequence_parallel=True)
    assert sp.to_dict()["sequence_parallel"] is True and Plan.from_dict(sp.to_dict()) == sp
    assert "sequence_parallel" not in sp.replace(sequence_parallel=False).to_dict()
    with pytest.raises(PlannerError, match="sequence_parallel must be true or false"):
        sp.replace(sequence_parallel="yes")
