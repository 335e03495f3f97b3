"""The planner prices what the runtime does with host shards (planner/cost/host_link.py [Note: staged
and pinned host copies]), and `fit` pins them where host memory and the locked-memory limit allow."""

from __future__ import annotations

import json
import resource
from dataclasses import replace

import pytest
from test_planner_throughput import COMPUTE_FWD, MODEL, NODE, P
from typer.testing import CliRunner

from planner.cost.host_link import (
    choose_host_pinning,
    landing_bytes_per_s,
    landing_host_bytes_per_byte,
    pinned_host_bytes,
)
from planner.cost.memory import memory_bill
from planner.cost.throughput import bandwidths, estimate
from planner.search.search import SearchRequest, search
from planner.sim import simulate
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.memory_terms import MemoryTerm
from planner.specs.plan import STRATEGY_TABLE, HostPinning, Placement, Plan
from planner.specs.tiers import HOST, NVME
from planner.specs.units import GB, GIB
from tierwise.cli import app

SLOW_COPY = replace(NODE, host_memcpy_bytes_per_s=5 * GB)
"""The round node (10 GB/s host links) with a host thread that copies at 5 GB/s: slower than the link."""
PARAMS_ON_HOST = Placement(params="cpu", gradients="gpu", optimizer_states="gpu", recompute_inputs="gpu")
OFFLOAD = Placement(params="cpu", gradients="cpu", optimizer_states="cpu", recompute_inputs="cpu")


def _plan(placement: Placement = PARAMS_ON_HOST, pinning: HostPinning = HostPinning.STAGED, node=SLOW_COPY, **kw) -> Plan:
    fields = {"model": MODEL, "node": node, "num_gpus": 1, "placement": placement, "prefetch_depth": 0,
              "recompute_interval": 0, "host_pinning": pinning} | kw
    return Plan(**fields)


def test_a_staged_copy_runs_at_the_slower_of_the_link_and_the_memcpy():
    # One GPU, depth 0: the forward is compute, then each operator's shard over the host link. Staged,
    # the shard's 2 P bytes cross at the 5 GB/s memcpy; pinned, at the 10 GB/s link.
    staged, pinned = estimate(_plan()), estimate(_plan(pinning=HostPinning.SHARDS))
    assert bandwidths(_plan()).reads[HOST] == 5 * GB and bandwidths(_plan(pinning=HostPinning.SHARDS)).reads[HOST] == 10 * GB
    assert pinned.phase_time_s["forward"] == pytest.approx(COMPUTE_FWD + 2 * P / (10 * GB))
    assert staged.phase_time_s["forward"] == pytest.approx(COMPUTE_FWD + 2 * P / (5 * GB))
    assert staged.link_bytes == pinned.link_bytes  # the same bytes cross; only the rate differs


def test_nvme_reads_to_a_device_are_not_staged():
    # They land in pinned read slots whatever the pinning (runtime/transfer/read_slots.py).
    nvme = Placement(params="nvme", gradients="gpu", optimizer_states="gpu", recompute_inputs="gpu")
    assert bandwidths(_plan(nvme)).reads[NVME] == bandwidths(_plan(nvme, HostPinning.SHARDS)).reads[NVME]


def test_gradients_land_at_the_workers_add_rate_either_way():
    # bf16: per element the add reads 2 + 4 bytes and writes 4, where the memcpy moves 2 + 2.
    assert landing_bytes_per_s(_plan(OFFLOAD)) == pytest.approx(5 * GB * 4 / 10)
    wide_memory = replace(SLOW_COPY, host_memory_bytes_per_s=400 * GB,  # the worker's thread sets the rate
                          sources={"host_memory_gb_per_s": "measured"})
    for pinning in HostPinning:
        bw = bandwidths(_plan(OFFLOAD, pinning, node=wide_memory))
        assert bw.landing == pytest.approx(2 * GB)
        est = estimate(_plan(OFFLOAD, pinning, node=wide_memory))
        assert est.component_time_s["gradients (cpu)"] == pytest.approx(2 * P / (2 * GB))


def test_a_landing_moves_six_bytes_of_host_memory_per_bf16_gradient_byte():
    # The DMA writes the bf16 gradient (2), the worker reads it (2) and the fp32 shard (4) and writes
    # the shard (4): 12 bytes per element. With the host memory's own rate from the probe (40 GB/s, 10 per
    # GPU of 4) a landing runs at 10 / 6 GB/s, below the worker's 2 GB/s.
    measured = replace(SLOW_COPY, sources={"host_memory_gb_per_s": "measured"})
    assert measured.host_memory_is_measured and not SLOW_COPY.host_memory_is_measured
    assert landing_host_bytes_per_byte(_plan(OFFLOAD)) == 6
    assert landing_host_bytes_per_byte(_plan(OFFLOAD, precision="fp32")) == 4
    assert bandwidths(_plan(OFFLOAD, node=measured)).landing == pytest.approx(10 * GB / 6)
    # The simulator routes the landing through the host memory at the same weight.
    resources = simulate(_plan(OFFLOAD, HostPinning.SHARDS, node=measured)).prediction.details["resources"]
    assert resources["host_memory"]["amount"] >= 6 * resources["host_landing"]["amount"]
    # A preset's host-memory figure is its GPUs' host traffic: the landing weighs its link bytes there.
    assert bandwidths(_plan(OFFLOAD)).landing == pytest.approx(2 * GB)
    unmeasured = simulate(_plan(OFFLOAD, HostPinning.SHARDS)).prediction.details["resources"]
    assert unmeasured["host_memory"]["amount"] < 6 * unmeasured["host_landing"]["amount"]


def test_the_simulator_routes_staged_copies_through_the_ranks_memcpy():
    staged, pinned = simulate(_plan()).prediction, simulate(_plan(pinning=HostPinning.SHARDS)).prediction
    assert staged.phase_time_s["forward"] > pinned.phase_time_s["forward"]
    assert staged.details["resources"]["host_memcpy"]["amount"] == pytest.approx(staged.link_bytes["h2d"])
    assert "host_memcpy" not in pinned.details["resources"]  # pinned shards cross at the link's rate
    assert staged.link_bytes == pinned.link_bytes


def test_the_two_copy_directions_are_independent_links():
    # A gradient leaving on d2h while the next shard arrives on h2d: neither slows the other.
    bw = bandwidths(_plan(OFFLOAD, HostPinning.SHARDS, node=NODE))
    assert (bw.h2d, bw.d2h) == (10 * GB, 10 * GB)
    resources = simulate(_plan(OFFLOAD, HostPinning.SHARDS, node=NODE, prefetch_depth=2)).prediction.details["resources"]
    assert {"h2d", "d2h"} <= set(resources)


H200 = resolve_hardware("h200-x1")


def _offload_plan(**kw) -> Plan:
    return Plan(model=resolve_model("gpt3-6.7b"), node=H200, num_gpus=1, placement=STRATEGY_TABLE["zero-offload"].placement,
                micro_batch_per_gpu=2, recompute_interval=1, **kw)


def test_fit_pins_the_host_shards_where_the_locked_memory_limit_allows():
    plan = _offload_plan()
    chosen, line = choose_host_pinning(plan, float("inf"))
    assert chosen.host_pinning is HostPinning.SHARDS and line == ""
    need = pinned_host_bytes(chosen)
    host = memory_bill(chosen).terms[HOST]
    assert need == host[MemoryTerm.GRADIENT_LANDING_BUFFERS] + host[MemoryTerm.PINNED_STAGING_POOL]
    assert choose_host_pinning(plan, need)[0].host_pinning is HostPinning.SHARDS


def test_a_low_locked_memory_limit_keeps_the_shards_staged_and_says_so_in_one_line():
    plan = _offload_plan()
    need = pinned_host_bytes(plan.replace(host_pinning=HostPinning.SHARDS))
    chosen, line = choose_host_pinning(plan, need - 1)
    assert chosen.host_pinning is HostPinning.STAGED
    assert "\n" not in line and "ulimit -l" in line and f"{need / GIB:,.2f} GiB" in line


def test_pinning_that_does_not_fit_host_memory_stays_staged():
    plan = _offload_plan()
    staged_host = memory_bill(plan).peak_bytes[HOST]
    tight = plan.replace(node=replace(H200, cpu_memory_bytes=staged_host + 1))  # the staged bill just fits
    assert memory_bill(tight).fits and not memory_bill(tight.replace(host_pinning=HostPinning.SHARDS)).fits
    chosen, line = choose_host_pinning(tight, float("inf"))
    assert chosen.host_pinning is HostPinning.STAGED and "does not fit" in line


def test_nothing_is_pinned_where_the_host_is_the_device():
    cpu = resolve_hardware("cpu-dev-2core")
    plan = Plan(model=resolve_model("100m"), node=cpu, num_gpus=1, placement=OFFLOAD, recompute_interval=1)
    assert choose_host_pinning(plan, 0) == (plan, "") and pinned_host_bytes(plan) == 0


def test_the_search_pins_by_the_requests_limit():
    request = SearchRequest(model=resolve_model("gpt3-6.7b"), node=H200, num_gpus=1, strategy="zero-offload",
                            recompute_interval=1, prefetch_depth=1, tiling_factor=1)
    assert search(request).best.host_pinning is HostPinning.SHARDS
    assert search(replace(request, locked_memory_bytes=64 * 2**20)).best.host_pinning is HostPinning.STAGED


def test_fit_says_when_the_limit_forbids_pinning(monkeypatch, tmp_path):
    runner = CliRunner()
    args = ["fit", "gpt3-6.7b", "--gpus", "1", "--hardware", "h200-x1", "--strategy", "zero-offload"]
    assert "ulimit -l" not in runner.invoke(app, args).output  # a named preset: unlimited
    low = runner.invoke(app, [*args, "--locked-memory", "0.5"])
    assert low.exit_code == 0 and [line for line in low.output.splitlines() if "ulimit -l" in line]
    # a hardware file is this machine's: its RLIMIT_MEMLOCK applies unless the flag says otherwise
    spec = tmp_path / "h200.json"
    spec.write_text(json.dumps(H200.to_dict()))
    monkeypatch.setattr(resource, "getrlimit", lambda which: (8 * 2**20, 8 * 2**20))
    local = runner.invoke(app, ["fit", "gpt3-6.7b", "--gpus", "1", "--hardware", str(spec), "--strategy", "zero-offload"])
    assert local.exit_code == 0 and "over the limit of 0.01 GiB" in local.output
    bad = runner.invoke(app, [*args, "--locked-memory", "lots"])
    assert bad.exit_code == 1 and "--locked-memory takes 'unlimited', 'local' or a size in GiB" in str(bad.exception)
