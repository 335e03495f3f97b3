"""`host_param_shard: master` (planner/specs/plan.py `HostParamShard`): a mixed-precision plan whose
parameters and optimizer states are in host memory reads its fp32 master as its parameter shard.

Training is the same bit for bit as with the 16-bit copy (the cast to the compute precision rounds to
nearest even wherever it runs), the ledger holds what the bill says, checkpoints resume across the two,
and the planner prices one against the other (planner/cost/host_work.py [Note: the resident step's cast])."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from runtime_support import ALL_CPU, HARDWARE, LLAMA_MODEL, _loss, batches, build_model, run_distributed

import runtime
from planner.cost.host_work import (
    host_param_read_bytes,
    resident_cast_bytes_per_param,
    step_cpu_params_per_param,
)
from planner.cost.memory import memory_bill
from planner.cost.throughput import estimate
from planner.search.search import SearchRequest, choose_host_param_shard, search
from planner.sim import simulate
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.errors import PlannerError
from planner.specs.memory_terms import MemoryTerm
from planner.specs.plan import HostParamShard, HostPinning, Placement, Plan
from planner.specs.tiers import HOST

STEPS = 4
OFFLOAD = Placement(**ALL_CPU)


def _doc(shard: str, step: str = "after_backward", world_size: int = 1) -> dict[str, Any]:
    return {"model": LLAMA_MODEL, "hardware": HARDWARE, "num_gpus": world_size, "precision": "bf16",
            "recompute_interval": 0, "placement": ALL_CPU, "optimizer_step": step, "host_param_shard": shard}


def trained(plan: dict[str, Any], steps: int = STEPS, rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """Losses (as float hex, this rank's), and per unit the digest of the fp32 master and of the 16-bit
    shard the compute reads, after `steps` steps of `build_model("llama")`."""
    model = runtime.shard(build_model("llama"), plan)
    opt = runtime.AdamW(model, lr=1e-3, weight_decay=0.1)
    losses = []
    for tokens in batches(steps):
        loss = _loss(model, tokens.chunk(world_size)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item().hex())
    state = runtime.state_of(model)
    masters, copies, copy_is_cast = {}, {}, True
    for unit in state.units:
        master = state.masters[unit.name]
        shard = state.param_store.resident(unit.name)
        compute = shard if shard.dtype == torch.bfloat16 else shard.to(torch.bfloat16)
        copy_is_cast &= torch.equal(compute.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))
        masters[str(unit.name)] = hashlib.sha256(master.numpy().tobytes()).hexdigest()
        copies[str(unit.name)] = hashlib.sha256(compute.view(torch.int16).numpy().tobytes()).hexdigest()
    dtype = str(state.param_store.resident(state.units[0].name).dtype)
    opt.close()  # joins the in-backward worker thread (later tests assert none is left running)
    state.close()
    return {"losses": losses, "masters": masters, "copies": copies, "copy_is_cast": copy_is_cast, "shard_dtype": dtype}


@pytest.mark.parametrize("step", ["after_backward", "in_backward"])
def test_the_master_as_shard_trains_bit_for_bit_as_the_16_bit_copy(step: str) -> None:
    copy, master = trained(_doc("compute_copy", step)), trained(_doc("master", step))
    assert (copy["shard_dtype"], master["shard_dtype"]) == ("torch.bfloat16", "torch.float32")
    assert copy["copy_is_cast"]  # the host's cast of the master is torch's round-to-nearest-even cast
    assert master["losses"] == copy["losses"]
    assert master["masters"] == copy["masters"]
    assert master["copies"] == copy["copies"]


def test_the_master_as_shard_trains_bit_for_bit_on_two_ranks(tmp_path: Path) -> None:
    cases = [(_doc(shard, step, 2), STEPS) for step in ("after_backward", "in_backward")
             for shard in ("compute_copy", "master")]
    after_copy, after_master, in_copy, in_master = run_distributed("trained", cases, tmp_path,
                                                                   module="test_host_param_shard")
    for copy, master in ((after_copy, after_master), (in_copy, in_master)):
        assert master["losses"] == copy["losses"]
        assert master["masters"] == copy["masters"]
        assert master["copies"] == copy["copies"]


def test_the_bill_holds_one_fewer_host_copy() -> None:
    # The ledger against the bill: tests/test_runtime_memory.py, case bf16-all-cpu-master.
    master = memory_bill(Plan.from_dict(_doc("master"))).terms[HOST]
    copy = memory_bill(Plan.from_dict(_doc("compute_copy"))).terms[HOST]
    params = Plan.from_dict(_doc("master")).model.num_params
    assert master[MemoryTerm.PARAMS] == 2 * copy[MemoryTerm.PARAMS]
    states = master[MemoryTerm.PARAMS] + master[MemoryTerm.OPTIMIZER_STATES]
    assert states == pytest.approx(copy[MemoryTerm.PARAMS] + copy[MemoryTerm.OPTIMIZER_STATES] - 2 * params, abs=8)


def _checkpointed(plan: dict[str, Any], root: Path, *, resume_from: Path | None = None) -> list[str]:
    """Two steps (saved after the second) or, with `resume_from`, two more steps after restoring its
    checkpoint: the losses as float hex."""
    from runtime.ckpt import Checkpointer
    from runtime.plan_io import resolve_plan

    model = runtime.shard(build_model("llama"), plan)
    opt = runtime.AdamW(model, lr=1e-3, weight_decay=0.1)
    state = runtime.state_of(model)
    data = batches(4)
    if resume_from is not None:
        Checkpointer(resume_from, plan=resolve_plan(plan), seed=0, rank=0, world_size=1, resume=True).restore(state, opt)
        data = data[2:]
    else:
        data = data[:2]
    losses = []
    for tokens in data:
        loss = _loss(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item().hex())
    if resume_from is None:
        Checkpointer(root, plan=resolve_plan(plan), seed=0, rank=0, world_size=1, resume=False).save(
            2, state, opt, scalars={})
    opt.close()  # joins the in-backward worker thread (later tests assert none is left running)
    state.close()
    return losses


def test_checkpoints_are_the_same_files_and_resume_across_the_two(tmp_path: Path) -> None:
    copy, master = _doc("compute_copy"), _doc("master")
    _checkpointed(copy, tmp_path / "copy")
    _checkpointed(master, tmp_path / "master")
    files = sorted(p.relative_to(tmp_path / "copy") for p in (tmp_path / "copy").rglob("*") if p.is_file())
    assert files
    for name in files:  # [Note: one checkpoint for both host parameter shards]
        assert (tmp_path / "copy" / name).read_bytes() == (tmp_path / "master" / name).read_bytes(), name
    straight = trained(copy)["losses"][2:]
    assert _checkpointed(master, tmp_path / "x", resume_from=tmp_path / "copy") == straight
    assert _checkpointed(copy, tmp_path / "y", resume_from=tmp_path / "master") == straight


def test_a_plan_refuses_the_master_as_shard_where_it_cannot_be() -> None:
    with pytest.raises(PlannerError, match="host_param_shard master needs precision bf16 or fp16"):
        Plan.from_dict({**_doc("master"), "precision": "fp32"})
    with pytest.raises(PlannerError, match="host_param_shard master needs"):
        Plan.from_dict({**_doc("master"), "placement": {**ALL_CPU, "params": "gpu"}})
    with pytest.raises(PlannerError, match="host_param_shard"):
        Plan.from_dict({**_doc("master"), "host_param_shard": "fp32"})
    plan = Plan.from_dict(_doc("compute_copy"))
    assert "host_param_shard" not in plan.to_dict()  # plans with the copy are written as before
    assert Plan.from_dict(plan.replace(host_param_shard=HostParamShard.MASTER).to_dict()).host_param_shard is (
        HostParamShard.MASTER)


H200 = resolve_hardware("h200-x1")
LLAMA_1B = resolve_model("paper-1.4b")


def _h200(shard: HostParamShard, pinning: HostPinning = HostPinning.SHARDS, step: str = "in_backward") -> Plan:
    return Plan(model=LLAMA_1B, node=H200, num_gpus=1, placement=OFFLOAD, micro_batch_per_gpu=4, recompute_interval=0,
                host_pinning=pinning, optimizer_step=step, host_param_shard=shard)


def test_the_planner_prices_the_cast_against_the_wider_reads() -> None:
    copy, master = _h200(HostParamShard.COMPUTE_COPY), _h200(HostParamShard.MASTER)
    assert resident_cast_bytes_per_param(copy) == 6 and resident_cast_bytes_per_param(master) == 0
    assert (host_param_read_bytes(copy), host_param_read_bytes(master)) == (2, 4)
    node = H200
    assert step_cpu_params_per_param(copy) == pytest.approx(
        1 + 6 * node.cpu_adam_params_per_s / node.host_memory_bytes_per_s)
    assert step_cpu_params_per_param(master) == 1
    a, b = estimate(copy), estimate(master)
    # The parameters cross the host link once in forward and once in backward: 2 bytes more each.
    assert b.link_bytes["h2d"] - a.link_bytes["h2d"] == pytest.approx(2 * 2 * copy.model.num_params, rel=1e-9)
    sim_a, sim_b = simulate(copy).prediction, simulate(master).prediction
    assert sim_b.link_bytes["h2d"] - sim_a.link_bytes["h2d"] == pytest.approx(
        b.link_bytes["h2d"] - a.link_bytes["h2d"], rel=0.02)
    # The pinned host bytes follow the shard: the fp32 master is pinned instead of the 16-bit copy.
    pinned = memory_bill(master).terms[HOST][MemoryTerm.PARAMS]
    assert pinned == 2 * memory_bill(copy).terms[HOST][MemoryTerm.PARAMS]


def test_fit_reads_the_master_where_the_cast_costs_more_than_the_link() -> None:
    copy = _h200(HostParamShard.COMPUTE_COPY)
    chosen, _ = choose_host_param_shard(copy, memory_bill(copy), float("inf"))
    faster = min((copy, _h200(HostParamShard.MASTER)), key=lambda p: estimate(p).iteration_time_s)
    assert chosen.host_param_shard is faster.host_param_shard
    # Not where it may not: parameters on the GPU.
    on_gpu = copy.replace(placement=Placement(params="gpu", gradients="cpu", optimizer_states="cpu",
                                              recompute_inputs="gpu"))
    assert choose_host_param_shard(on_gpu, None, float("inf"))[0] is on_gpu


def test_fit_chooses_between_the_two_for_every_host_candidate() -> None:
    result = search(SearchRequest(model=LLAMA_1B, node=H200, num_gpus=1, placement_pins=dict.fromkeys(ALL_CPU, HOST),
                                  recompute_interval=0, micro_batch_per_gpu=4))
    for plan in result.ranked:
        other = plan.replace(host_param_shard=HostParamShard.MASTER if plan.host_param_shard is
                             HostParamShard.COMPUTE_COPY else HostParamShard.COMPUTE_COPY, prediction=None)
        assert estimate(plan).iteration_time_s <= estimate(other).iteration_time_s or not memory_bill(other).fits
