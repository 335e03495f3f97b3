"""torchtitan's two checkpointing policies as recompute kinds of a plan (planner/cost/kernels.py [Note:
recompute]): `every_nth_block` (every N-th block recomputed whole, the others keep everything) and
`op_level` (the odd-numbered matmuls' and the attention kernel's outputs kept, the rest recomputed).
Hand-computed shares, flops, bytes and bills; the analytic estimate, the simulator and the bill agree;
a plan round-trips."""

import pytest
from test_planner_kernels import LLAMA, node, plan

from planner.cost.kernels import (
    attention_flops,
    block_cost,
    kernel_bytes,
    recomputed_block_share,
    recomputed_linear_share,
)
from planner.cost.memory import activation_working_bytes, memory_bill, recompute_working_bytes
from planner.cost.throughput import estimate
from planner.sim.report import simulate
from planner.specs.errors import PlannerError
from planner.specs.plan import Plan

LLAMA4 = LLAMA.replace(num_layers=4)
TOKENS, HD, E = 2048, 1024, 2
WHOLE = 16 * HD + 4 * 8  # eq. 5 per token and block under flash: 16 hd and the softmax statistics (4 heads)


def kind(name: str, model=LLAMA4, **kw) -> Plan:
    kw.setdefault("attention", "flash")
    return plan(model, recompute_interval=0, recompute=name, **kw)


def test_every_nth_block_recomputes_floor_l_over_n_blocks():
    assert recomputed_block_share(kind("every_nth_block")) == 0.5  # blocks 2 and 4 of 4
    assert recomputed_block_share(kind("every_nth_block", recompute_block_period=3)) == 0.25  # block 3 only
    assert recomputed_block_share(kind("every_nth_block", recompute_block_period=1)) == 1.0
    assert recomputed_block_share(kind("op_level")) == recomputed_block_share(kind("none")) == 0.0


def test_op_level_recomputes_wk_wo_and_w3():
    # LLAMA: hd 1024, q 1024, kv 256 (2 of 8 heads), ffn 2816; wq wk wv wo w1 w3 w2, the 2nd, 4th, 6th again.
    weights = 1024 + 256 + 256 + 1024 + 3 * 2816
    assert recomputed_linear_share(kind("op_level")) == pytest.approx((256 + 1024 + 2816) / weights)
    none, op = block_cost(kind("none")), block_cost(kind("op_level"))
    assert op.recompute_linear_flops == pytest.approx(none.linear_flops * (256 + 1024 + 2816) / weights)
    assert op.matmul_backward_flops == pytest.approx(2 * none.linear_flops + op.recompute_linear_flops)
    assert attention_flops(kind("op_level")) == attention_flops(kind("none"))  # the attention output is kept


def test_recomputed_forward_work_lands_in_the_backward():
    fwd, bwd_none = kernel_bytes(kind("none"))
    _, bwd_nth = kernel_bytes(kind("every_nth_block"))
    _, bwd_op = kernel_bytes(kind("op_level"))
    assert bwd_nth == {**bwd_none, "recompute": 0.5 * sum(fwd.values())}
    assert bwd_op == {**bwd_none, "recompute": sum(fwd.values())}  # every elementwise kernel, none of them the core's
    square_half = 4 * 2048**2 * 1024 / 2  # flash's causal forward
    assert attention_flops(kind("every_nth_block")) == (square_half, 3.0 * square_half)  # 2.5 + half a forward again
    eager_fwd, eager_bwd = attention_flops(kind("every_nth_block", attention="eager"))
    assert eager_bwd == 2.5 * eager_fwd
    # Eager's core kernels are kept by op_level.
    fwd_e, bwd_e = kernel_bytes(kind("op_level", attention="eager"))
    assert bwd_e["recompute"] == sum(v for k, v in fwd_e.items() if k not in ("softmax", "score_products"))


def test_each_kind_bills_what_it_keeps_and_what_one_block_recomputes():
    layers = 4
    nth = kind("every_nth_block")
    kept = 0.5 * WHOLE + 0.5 * E * HD  # two blocks keep everything, two only their input
    assert recompute_working_bytes(nth) == TOKENS * (WHOLE - E * HD)
    assert activation_working_bytes(nth) == TOKENS * (layers * kept + WHOLE - E * HD)
    op = kind("op_level")
    saved = E * (HD + 1024 + (1024 + 256 + 2816 + HD)) + 4 * 8  # input, attention output, wq wv w1 w2, statistics
    assert recompute_working_bytes(op) == TOKENS * (WHOLE - saved)
    assert activation_working_bytes(op) == TOKENS * (layers * saved + WHOLE - saved)
    assert activation_working_bytes(kind("none")) == TOKENS * layers * WHOLE
    assert activation_working_bytes(nth) < activation_working_bytes(op) < activation_working_bytes(kind("none"))


@pytest.mark.parametrize("name, kw", [("every_nth_block", {}), ("every_nth_block", {"recompute_block_period": 3}),
                                      ("op_level", {}), ("every_nth_block", {"attention": "eager"}),
                                      ("op_level", {"attention": "eager"})])
def test_estimate_simulator_and_bill_agree(name, kw):
    p = kind(name, **kw)
    est, sim = estimate(p), simulate(p).prediction
    for phase in ("forward", "backward"):
        assert sim.phase_time_s[phase] == pytest.approx(est.phase_time_s[phase], rel=1e-9), phase
    assert sim.memory_terms["gpu"]["awm"] == memory_bill(p).terms["gpu"]["awm"]
    # Without the logits (which the backward frees before the blocks' own), the simulated activations
    # peak where the bill puts them: every block's kept bytes and one block's recompute at once.
    headless = p.replace(model=p.model.replace(vocab_size=0))
    simulated = simulate(headless).prediction.details["simulated_memory_terms"]["gpu"]["activations"]
    assert simulated == pytest.approx(memory_bill(headless).terms["gpu"]["awm"], rel=1e-6)


def test_backward_time_orders_the_kinds():
    backward = {name: estimate(kind(name)).phase_time_s["backward"]
                for name in ("none", "op_level", "every_nth_block")}
    full = estimate(plan(LLAMA4, attention="flash", recompute_interval=1)).phase_time_s["backward"]
    assert backward["none"] < backward["op_level"] < backward["every_nth_block"] < full
    # Half the blocks recomputed whole: half of full recompute's extra forward.
    assert backward["every_nth_block"] - backward["none"] == pytest.approx((full - backward["none"]) / 2, rel=0.05)


def test_a_plan_round_trips_and_states_the_period_only_with_its_kind():
    nth = kind("every_nth_block", recompute_block_period=3)
    doc = nth.to_dict()
    assert (doc["recompute"], doc["recompute_interval"], doc["recompute_block_period"]) == ("every_nth_block", 0, 3)
    assert Plan.from_dict(doc) == nth
    op = kind("op_level")
    assert "recompute_block_period" not in op.to_dict() and Plan.from_dict(op.to_dict()) == op
    assert nth.replace(recompute_interval=0).recompute == "every_nth_block"
    assert nth.replace(recompute_interval=1).recompute == "full"
    with pytest.raises(PlannerError, match="recompute_block_period"):
        kind("every_nth_block", recompute_block_period=0)
    with pytest.raises(PlannerError, match="needs recompute_interval"):
        plan(LLAMA4, recompute="op_level", recompute_interval=1)


@pytest.mark.parametrize("name", ["every_nth_block", "op_level"])
def test_fp8_times_the_recomputed_linears_at_its_rate_in_both_methods(name):
    p = kind(name, node=node(fp8_matmul_flops_per_s=200e12), fp8_matmuls=True)
    est, sim = estimate(p), simulate(p).prediction
    assert sim.phase_time_s["backward"] == pytest.approx(est.phase_time_s["backward"], rel=1e-9)
    bf16 = estimate(p.replace(fp8_matmuls=False)).phase_time_s["backward"]
    assert est.phase_time_s["backward"] < bf16
