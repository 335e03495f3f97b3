"""Property-based fuzzing of the planner's parsers and CLI: every failure is a clean PlannerError.

Documents are valid ones with a key replaced by arbitrary JSON, removed, or joined by an unknown key,
plus arbitrary JSON objects; CLI arguments are random option values. Nothing may escape as another
exception type (a traceback for the user).
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from planner.search.search import predict
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.errors import PlannerError
from planner.specs.hardware import NodeSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import STRATEGY_TABLE, Plan, parse_placement_pins
from tierwise.cli import app

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
)
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                  st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=10)

MODEL_DOC = resolve_model("1.4B").to_dict()
HARDWARE_DOC = resolve_hardware("dgx-h100").to_dict()
PLAN_DOC = predict(Plan(model=resolve_model("1.4B"), node=resolve_hardware("dgx-h100"), num_gpus=8,
                        strategy="zero-inf-cpu", placement=STRATEGY_TABLE["zero-inf-cpu"].placement)).to_dict()


@st.composite
def mutated(draw, base: dict):
    doc = json.loads(json.dumps(base))
    target = doc
    # sometimes mutate inside a nested object (plan.model, plan.placement, ...)
    nested = [k for k, v in doc.items() if isinstance(v, dict)]
    if nested and draw(st.booleans()):
        target = doc[draw(st.sampled_from(nested))]
    action = draw(st.sampled_from(["replace", "delete", "add"]))
    keys = list(target)
    if action == "replace" and keys:
        target[draw(st.sampled_from(keys))] = draw(json_values)
    elif action == "delete" and keys:
        del target[draw(st.sampled_from(keys))]
    else:
        target[draw(st.text(max_size=10))] = draw(json_values)
    return doc


def _parse_cleanly(parse, doc) -> None:
    try:
        parse(doc)
    except PlannerError as exc:
        message = str(exc)
        assert message and "\n" not in message


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.one_of(mutated(MODEL_DOC), st.dictionaries(st.text(max_size=12), json_values, max_size=6)))
def test_model_documents(doc):
    _parse_cleanly(ModelSpec.from_dict, doc)


@FUZZ
@given(mutated(HARDWARE_DOC))
def test_hardware_documents(doc):
    _parse_cleanly(NodeSpec.from_dict, doc)


@FUZZ
@given(mutated(PLAN_DOC))
def test_plan_documents(doc):
    def parse_and_use(d):
        plan = Plan.from_dict(d)
        predict(plan)  # a plan that parses must also be plannable
        json.dumps(plan.to_dict(), allow_nan=False)

    _parse_cleanly(parse_and_use, doc)


@FUZZ
@given(st.text(max_size=40))
def test_placement_pins(text):
    _parse_cleanly(parse_placement_pins, text)


option_values = st.one_of(
    st.integers(min_value=-5, max_value=10**7).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.text(alphabet="0123456789.-eEnaifT", max_size=8),
)


@pytest.mark.slow  # two hundred `planner fit` calls, about 25 s on 2 cores: CI runs it (`-m slow`)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=st.one_of(st.sampled_from(["1T", "1.4B", "13b", "gpt3-125m", "0.0001B", "1e3B", "-1B"]), st.text(max_size=6)),
    option=st.sampled_from(["--gpus", "--batch-per-gpu", "--recompute-interval", "--tiling-factor", "--prefetch-depth",
                            "--model-parallel", "--max-alloc-gib", "--seq", "--layers", "--max-batch-per-gpu"]),
    value=option_values,
)
def test_fit_cli_options(model, option, value):
    runner = CliRunner()
    args = ["fit", model, "--hardware", "dgx2-v100", "--json", option, value]
    if option != "--gpus":
        args += ["--gpus", "16"]
    try:
        result = runner.invoke(app, args, catch_exceptions=False)
    except PlannerError:
        return
    # 0: answered (fits or not); 2: click rejected the value's type
    assert result.exit_code in (0, 2), result.output
    if result.exit_code == 0:
        doc = json.loads(result.stdout)
        pred = doc["prediction"]
        assert isinstance(pred["feasible"], bool)
        assert all(math.isfinite(v) for v in pred["peak_bytes"].values())


@pytest.mark.parametrize("value", ["2.225073858507203e-309", "0.0005"])
def test_a_largest_allocation_under_one_mib_is_refused(value: str) -> None:
    """A largest free block under 1 MiB is refused with the value named (a denormal once overflowed the
    tile count to infinity); a hardware file stating one is refused the same way."""
    with pytest.raises(PlannerError, match=f"--max-alloc-gib {float(value)!r} is below 1 MiB"):
        CliRunner().invoke(app, ["fit", "1T", "--gpus", "16", "--max-alloc-gib", value], catch_exceptions=False)
    doc = resolve_hardware("dgx2-v100").to_dict() | {"gpu_max_alloc_gib": float(value)}
    with pytest.raises(PlannerError, match="gpu_max_alloc_gib .* is below 1 MiB"):
        NodeSpec.from_dict(doc, "a hardware file")
