"""Planning for the machine you sit at: `--hardware local` probes it once (runtime/local_hardware.py),
the probe times compute in every precision (runtime/precision_probe.py), a plan is priced in its own
precision (planner/specs/hardware.py [Note: a plan's precision prices its compute]) and an emulated
16-bit precision is not chosen unless pinned (planner/specs/precision.py [Note: emulated precisions]).

Every time here is given (an injected timer, a given probe): the tests check the mechanism, not the
machine; benchmarks/local_hardware.py measures it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.specs.catalog import hardware_presets
from planner.specs.errors import PlannerError
from planner.specs.hardware import NodeSpec
from planner.specs.plan import Plan
from planner.specs.precision import PrecisionChoice, PrecisionRates, choose_precision, emulation_slowdown
from tierwise.cli import app

TFLOP = 1e12
# Seconds per forward / forward+backward pass of the probe's block, per precision, as an AMD EPYC
# without AVX-512 ran them (docs/notes/2026-11-28-local-hardware-precisions.md): bf16 and fp16 are
# emulated, their backward far slower than their forward.
EMULATING_CPU = {"fp32": (1.0, 3.0), "bf16": (5.0, 80.0), "fp16": (4.0, 90.0)}
NATIVE_BF16_CPU = {"fp32": (1.0, 3.0), "bf16": (0.5, 1.5), "fp16": (0.6, 1.8)}


def _timer(seconds: dict[str, tuple[float, float]], calls: list):  # noqa: ANN202
    """A pass timer: a pass of the full block takes `seconds[precision]` (forward, forward+backward),
    one of the screen's block the same share of it as its flops."""
    from runtime.precision_probe import LinearPass

    full = LinearPass("fp32", 64, 128, backward=False).forward_flops

    def time_pass(p):  # noqa: ANN001, ANN202
        calls.append(p)
        forward_s, both_s = seconds[p.precision]
        return (both_s if p.backward else forward_s) * p.forward_flops / full

    return time_pass


def _measure(seconds, calls=None):  # noqa: ANN001, ANN202
    from runtime.precision_probe import measure_precisions

    return measure_precisions(_timer(seconds, [] if calls is None else calls), hidden=64, rows=128)


def test_the_probe_measures_every_precision_and_only_the_fast_ones_in_full():
    from runtime.precision_probe import FULL_ROUNDS, SCREEN_HIDDEN, SCREEN_ROUNDS, SCREEN_ROWS, LinearPass

    calls: list = []
    measured = _measure(EMULATING_CPU, calls)
    assert measured.fastest == "fp32" and set(measured.rates) == {"fp32", "bf16", "fp16"}
    assert measured.screened_only == ("bf16", "fp16")  # emulated: screened, never timed at full size
    full = [c for c in calls if (c.hidden, c.rows) == (64, 128)]
    assert {c.precision for c in full} == {"fp32"} and len(full) == 2 * FULL_ROUNDS  # forward, then both, per round
    assert len(calls) - len(full) == 3 * 2 * SCREEN_ROUNDS  # every precision screened, taking turns
    assert {(c.hidden, c.rows) for c in calls} == {(64, 128), (SCREEN_HIDDEN, SCREEN_ROWS)}
    flops = LinearPass("fp32", 64, 128, backward=False).forward_flops
    fp32 = measured.rates["fp32"]
    assert fp32.matmul_flops_per_s == pytest.approx(flops / 1.0)
    assert fp32.backward_matmul_flops_per_s == pytest.approx(2 * flops / (3.0 - 1.0))
    # A screened precision keeps its ratio to the fastest: bf16's backward pass is 75/2 of fp32's.
    bf16 = measured.rates["bf16"]
    assert bf16.matmul_flops_per_s == pytest.approx(fp32.matmul_flops_per_s / 5)
    assert bf16.backward_matmul_flops_per_s == pytest.approx(fp32.backward_matmul_flops_per_s * 2 / 75)


def test_a_cpu_with_native_bf16_states_its_rates_in_bf16():
    measured = _measure(NATIVE_BF16_CPU)
    assert measured.fastest == "bf16" and measured.screened_only == ()
    assert not emulation_slowdown(measured.rates, "bf16") and not emulation_slowdown(measured.rates, "fp16")


def _probed_node(seconds: dict[str, tuple[float, float]]) -> NodeSpec:
    """A probed CPU's spec whose rates come from `_measure(seconds)`, stated in the fastest precision."""
    measured = _measure(seconds)
    stated = measured.rates[measured.fastest]
    doc = hardware_presets()["cpu-dev-2core"].to_dict()
    doc.update(name="local", gpu_peak_tflops=stated.matmul_flops_per_s / TFLOP,
               backward_matmul_tflops=stated.backward_matmul_flops_per_s / TFLOP,
               flash_attention_tflops=0.5 * stated.matmul_flops_per_s / TFLOP, compute_precision=measured.fastest,
               precision_rates={p: r.to_dict() for p, r in measured.rates.items()})
    return NodeSpec.from_dict(doc, "probed")


def test_emulated_bf16_is_detected_and_fp32_chosen_unless_pinned():
    node = _probed_node(EMULATING_CPU)
    rates = dict(node.precision_rates)
    assert emulation_slowdown(rates, "bf16") == pytest.approx(
        rates["fp32"].training_flops_per_s / rates["bf16"].training_flops_per_s)
    chosen = choose_precision(rates, node.name, None)
    assert chosen.precision == "fp32"
    assert chosen.note.startswith("note: bf16 is emulated on local") and "planning in fp32" in chosen.note
    pinned = choose_precision(rates, node.name, "bf16")
    assert pinned.precision == "bf16" and "--precision fp32" in pinned.note
    assert choose_precision(rates, node.name, "fp32") == PrecisionChoice("fp32")
    # Native bf16, and a preset (one published rate for every precision): bf16, without a word.
    assert choose_precision(dict(_probed_node(NATIVE_BF16_CPU).precision_rates), "local", None).precision == "bf16"
    assert choose_precision(dict(hardware_presets()["dgx-h100"].precision_rates), "dgx-h100", None).note == ""


def _plan(node: NodeSpec, precision: str) -> Plan:
    from planner.cost.feasibility import check_plan
    from planner.search.search import predict

    return predict(check_plan(Plan.from_dict({
        "model": {"num_layers": 2, "hidden_size": 256, "num_heads": 4, "seq_len": 128, "vocab_size": 256},
        "hardware": node.to_dict(), "num_gpus": 1, "precision": precision, "micro_batch_per_gpu": 4})))


def test_a_plan_is_priced_at_its_own_precisions_rates():
    node = _probed_node(EMULATING_CPU)
    fp32, bf16 = _plan(node, "fp32"), _plan(node, "bf16")
    rates = dict(node.precision_rates)
    assert fp32.node.gpu_flops_per_s == node.gpu_flops_per_s  # stated in fp32 already
    assert bf16.node.compute_precision == "bf16"
    assert bf16.node.gpu_flops_per_s == pytest.approx(rates["bf16"].matmul_flops_per_s)
    assert bf16.node.backward_matmul_rate == pytest.approx(rates["bf16"].backward_matmul_flops_per_s)
    assert bf16.prediction.phase_time_s["backward"] > 10 * fp32.prediction.phase_time_s["backward"]
    # Idempotent: the plan's node is in its precision, and a plan read back prices the same.
    again = Plan.from_dict(bf16.to_dict())
    assert again.node.gpu_flops_per_s == pytest.approx(bf16.node.gpu_flops_per_s)
    assert bf16.replace(precision="fp32").node.gpu_flops_per_s == pytest.approx(node.gpu_flops_per_s)
    # A calibrated spec (its stated rate fitted to half) carries the fit into every precision.
    halved = node.replace(gpu_flops_per_s=node.gpu_flops_per_s / 2)
    assert _plan(halved, "bf16").node.gpu_flops_per_s == pytest.approx(rates["bf16"].matmul_flops_per_s / 2)
    # A preset prices every precision at its one rate.
    preset = hardware_presets()["cpu-dev-2core"]
    assert _plan(preset, "bf16").node.gpu_flops_per_s == _plan(preset, "fp32").node.gpu_flops_per_s


def test_precision_rates_round_trip_and_bad_ones_are_one_line():
    node = _probed_node(EMULATING_CPU)
    assert NodeSpec.from_dict(node.to_dict()) == node
    doc = node.to_dict()
    with pytest.raises(PlannerError, match="compute_precision"):
        NodeSpec.from_dict(dict(doc, compute_precision="fp8"))
    with pytest.raises(PlannerError, match="precision_rates"):
        NodeSpec.from_dict(dict(doc, precision_rates={"fp64": {"matmul_tflops": 1, "backward_matmul_tflops": 1}}))
    with pytest.raises(PlannerError, match="matmul_tflops"):
        PrecisionRates.from_dict({"matmul_tflops": 0, "backward_matmul_tflops": 1}, "x")


# -- the cache -------------------------------------------------------------------------------------
def _fingerprint(**changes):  # noqa: ANN003, ANN202
    from runtime.local_hardware import Fingerprint

    fields = dict(cpu_model="AMD EPYC", cores=2, memory_gib=24, gpus=(), torch_version="2.13.0+cpu")
    return Fingerprint(**{**fields, **changes})


def test_the_local_probe_is_cached_by_the_machines_fingerprint(tmp_path: Path):
    from runtime.local_hardware import CACHE_FILE, local_hardware

    probes: list[int] = []

    def probe() -> dict:
        probes.append(1)
        return dict(hardware_presets()["cpu-dev-2core"].to_dict(), name=f"local-{len(probes)}")

    first = local_hardware(tmp_path, fingerprint=_fingerprint(), probe=probe, clock=lambda: 0.0)
    assert first.probed and first.probed_at == "1970-01-01 00:00 UTC" and len(probes) == 1
    hit = local_hardware(tmp_path, fingerprint=_fingerprint(), probe=probe)
    assert not hit.probed and hit.document["name"] == "local-1" and len(probes) == 1
    assert "probe of 1970-01-01 00:00 UTC" in hit.line()
    for changed in (dict(cores=4), dict(memory_gib=32), dict(gpus=("NVIDIA H100 80GB HBM3",)),
                    dict(torch_version="2.14.0"), dict(cpu_model="Intel Xeon")):
        miss = local_hardware(tmp_path, fingerprint=_fingerprint(**changed), probe=probe)
        assert miss.probed, changed
    assert len(probes) == 6
    assert json.loads((tmp_path / CACHE_FILE).read_text())["fingerprint"]["cpu_model"] == "Intel Xeon"  # replaced
    (tmp_path / CACHE_FILE).write_text("{not json")
    assert local_hardware(tmp_path, fingerprint=_fingerprint(), probe=probe).probed  # unreadable: probed again
    assert local_hardware(tmp_path, fingerprint=_fingerprint(), probe=probe, refresh=True).probed
    assert len(probes) == 8


def test_fit_hardware_local_reads_the_cache_and_plans_in_fp32_where_bf16_is_emulated(tmp_path: Path, monkeypatch):
    from runtime.local_hardware import CACHE_FILE, this_fingerprint

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = tmp_path / "tierwise" / CACHE_FILE
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"fingerprint": this_fingerprint().to_dict(), "probed_at": "2026-11-28 00:00 UTC",
                                 "hardware": _probed_node(EMULATING_CPU).to_dict()}))
    args = ["fit", "--layers", "2", "--hidden", "256", "--heads", "4", "--seq", "128", "--vocab", "256", "--gpus", "1",
            "--hardware", "local", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "hardware local: this machine's probe of 2026-11-28 00:00 UTC" in result.stderr
    assert "bf16 is emulated on local" in result.stderr and "planning in fp32" in result.stderr
    assert json.loads(result.stdout)["precision"] == "fp32"
    pinned = CliRunner().invoke(app, [*args, "--precision", "bf16"])
    assert pinned.exit_code == 0, pinned.output
    assert json.loads(pinned.stdout)["precision"] == "bf16" and "--precision fp32 trains faster" in pinned.stderr


def test_simulate_and_memory_take_hardware_local(tmp_path: Path, monkeypatch):
    from runtime.local_hardware import CACHE_FILE, this_fingerprint

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    local = _probed_node(EMULATING_CPU)
    (tmp_path / "tierwise").mkdir()
    (tmp_path / "tierwise" / CACHE_FILE).write_text(json.dumps(
        {"fingerprint": this_fingerprint().to_dict(), "probed_at": "2026-11-28 00:00 UTC", "hardware": local.to_dict()}))
    plan = tmp_path / "plan.json"
    _plan(hardware_presets()["cpu-dev-2core"], "bf16").save(plan)
    result = CliRunner().invoke(app, ["simulate", str(plan), "--hardware", "local", "--json"])
    assert result.exit_code == 0, result.output
    simulated = json.loads(result.stdout)
    assert simulated["hardware"]["name"] == "local" and simulated["precision"] == "bf16"  # the plan's own, kept
    assert simulated["hardware"]["gpu_peak_tflops"] == pytest.approx(dict(local.precision_rates)["bf16"].matmul_flops_per_s
                                                                     / TFLOP)
    assert "bf16 is emulated on local" in result.stderr and "--precision fp32" in result.stderr
    memory = CliRunner().invoke(app, ["memory", "--layers", "2", "--hidden", "256", "--heads", "4", "--seq", "128",
                                      "--vocab", "256", "--hardware", "local", "--json"])
    assert memory.exit_code == 0, memory.output
    assert "planning in fp32" in memory.stderr
