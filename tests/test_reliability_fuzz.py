"""Property-based fuzzing of the remaining parsers and every CLI command: a clean one-line error or a
valid answer, never a traceback. Extends tests/test_planner_fuzz.py (model, hardware, plan,
placement pins, `fit` options) to the profile, the checkpoint manifest and rank index, the options
of `run`, `compare`, `calibrate`, `simulate`, `memory`, `max-size` and `probe`, and hostile `nvme_path` /
`--checkpoint-dir` values. 1,620 generated inputs in all (the `max_examples` below).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_planner_fuzz import PLAN_DOC, json_values, mutated, option_values
from typer.testing import CliRunner

from planner.specs.errors import PlannerError
from planner.specs.plan import LINKS, PHASES, TIERS, Plan
from planner.specs.profile import SCHEMA, Profile
from runtime.ckpt import check_checkpoint_dir
from runtime.ckpt.manifest import FORMAT, Manifest
from runtime.ckpt.rank_state import RANK_FORMAT_V1, read_rank_index
from runtime.nvme import SwapDirectory, SwapPathError
from tierwise.cli import app

FAST = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]}

SAMPLE = {"step": 1, "step_time_s": 0.5, "loss": 4.2, "phase_time_s": dict.fromkeys(PHASES, 0.1),
          "link_bytes": dict.fromkeys(LINKS, 1024), "peak_bytes": dict.fromkeys(TIERS, 1 << 20)}
PROFILE_DOC = {"schema": SCHEMA, "measured": PLAN_DOC["prediction"], "losses": [4.2, 4.1],
               "samples": [SAMPLE, {**SAMPLE, "step": 2, "loss": 4.1}], "warmup_steps": 1, "plan": {}, "details": {}}
MANIFEST_DOC = {"format": FORMAT, "step": 4, "world_size": 1, "fingerprint": "ab" * 32,
                "files": [{"name": "rank-00000.bin", "size_bytes": 4096, "sha256": "0" * 64},
                          {"name": "rank-00000.json", "size_bytes": 100, "sha256": "f" * 64}]}
INDEX_DOC = {"format": RANK_FORMAT_V1, "rank": 0, "step": 4, "python_rng": [3, [1, 2], None],
             "tensors": [{"name": "params/0:wte", "dtype": "float32", "numel": 8, "offset_bytes": 0},
                         {"name": "rng/torch_cpu", "dtype": "uint8", "numel": 16, "offset_bytes": 32}]}


def one_line(message: str) -> None:
    assert message and "\n" not in message.strip(), message


def parses_cleanly(parse, doc) -> None:  # noqa: ANN001
    try:
        parse(doc)
    except PlannerError as exc:
        one_line(str(exc))


def test_the_valid_documents_parse() -> None:
    assert Profile.from_dict(PROFILE_DOC).losses == [4.2, 4.1]
    assert Manifest.from_dict(MANIFEST_DOC).step == 4


@settings(max_examples=200, **FAST)
@given(st.one_of(mutated(PROFILE_DOC), st.dictionaries(st.text(max_size=10), json_values, max_size=6)))
def test_profile_documents(doc) -> None:  # noqa: ANN001
    parses_cleanly(Profile.from_dict, doc)


@settings(max_examples=200, **FAST)
@given(st.one_of(mutated(MANIFEST_DOC), st.dictionaries(st.text(max_size=10), json_values, max_size=6)))
def test_checkpoint_manifests(doc) -> None:  # noqa: ANN001
    try:
        manifest = Manifest.from_dict(doc)
    except PlannerError as exc:
        one_line(str(exc))
        return
    for f in manifest.files:  # what a manifest accepts is joined to the checkpoint directory
        assert "/" not in f.name and f.name.startswith("rank-")


@settings(max_examples=120, **FAST)
@given(doc=st.one_of(mutated(INDEX_DOC), json_values))
def test_checkpoint_rank_indexes(tmp_path: Path, doc) -> None:  # noqa: ANN001
    path = tmp_path / "rank-00000.json"
    path.write_text(json.dumps(doc))
    parses_cleanly(lambda _: read_rank_index(path, rank=0, step=4), doc)


def invoke(args: list[str]) -> None:
    """Run a CLI command: exit 0 (answered), 1 with one `error:` line, or 2 (click's usage error)."""
    try:
        result = CliRunner().invoke(app, args, catch_exceptions=False)
    except PlannerError as exc:  # tierwise.cli.main prints it as one line and exits 1
        one_line(str(exc))
        return
    assert result.exit_code in (0, 1, 2), result.output
    if result.exit_code == 1:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr


@pytest.fixture(scope="module")
def refused_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid plan the runtime refuses (model parallelism): `run` never starts a process."""
    path = tmp_path_factory.mktemp("plans") / "mp2.json"
    path.write_text(json.dumps({**PLAN_DOC, "model_parallel_degree": 2}))
    return path


hostile_paths = st.lists(st.sampled_from(["..", ".", "x", "ü", " ", "a b", "\x00", "~", "$HOME", "-rf", "*", "", "nul"]),
                         min_size=1, max_size=4).map(lambda parts: "./" + "/".join(parts))  # relative, always


@settings(max_examples=200, **FAST)
@given(option=st.sampled_from(["--steps", "--nproc", "--save-every", "--keep-checkpoints", "--max-restarts",
                               "--checkpoint-dir", "--data", "--profile-out"]),
       value=st.one_of(option_values, hostile_paths), resume=st.booleans())
def test_run_options(refused_plan: Path, option: str, value: str, resume: bool) -> None:
    args = ["run", str(refused_plan), "--no-history", option, value] + (["--resume"] if resume else [])
    invoke(args)


@settings(max_examples=150, **FAST)
@given(option=st.sampled_from(["--layers", "--hidden", "--heads", "--seq", "--vocab", "--batch-per-gpu",
                               "--recompute-interval", "--gpus", "--tiling-factor", "--prefetch-depth",
                               "--model-parallel", "--precision", "--strategy", "--placement", "--hardware"]),
       value=st.one_of(option_values, st.text(max_size=12)))
def test_memory_options(option: str, value: str) -> None:
    invoke(["memory", "1.4B", "--json", option, value])


@settings(max_examples=120, **FAST)
@given(option=st.sampled_from(["--strategy", "--gpus", "--seq", "--hardware"]),
       value=st.one_of(option_values, st.text(max_size=12)))
def test_max_size_options(option: str, value: str) -> None:
    base = {"--strategy": "zero3", "--gpus": "8", "--seq": "1024", "--hardware": "dgx-h100"}
    base[option] = value
    invoke(["max-size", "--json", *[x for kv in base.items() for x in kv]])


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    path.write_text(json.dumps(PLAN_DOC))
    return path


@pytest.mark.slow  # a hundred `planner simulate` calls in process, about 5 min on 2 cores: CI runs it (`-m slow`)
@settings(max_examples=100, **FAST)
@given(option=st.sampled_from(["--batch-per-gpu", "--recompute-interval", "--tiling-factor", "--prefetch-depth",
                               "--model-parallel", "--max-alloc-gib", "--placement", "--timeline"]),
       value=st.one_of(option_values, hostile_paths))
def test_simulate_options(plan_file: Path, option: str, value: str) -> None:
    # Mutated plan documents are fuzzed in test_planner_fuzz.py (parse + predict); simulating a
    # mutated million-layer model is slow, not wrong, so the simulator gets the valid plan here.
    if option == "--timeline":
        value = str(plan_file.parent / "missing-dir" / value)  # never written: the parent does not exist
    invoke(["simulate", str(plan_file), "--json", option, value])


@settings(max_examples=120, **FAST)
@given(profile=st.one_of(mutated(PROFILE_DOC), json_values), plan=st.one_of(st.just(PLAN_DOC), mutated(PLAN_DOC)))
def test_compare_documents(tmp_path: Path, profile, plan) -> None:  # noqa: ANN001
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    invoke(["compare", str(tmp_path / "plan.json"), str(tmp_path / "profile.json"), "--json"])


@settings(max_examples=60, **FAST)
@given(suffix=hostile_paths, gib=option_values)
def test_probe_refuses_hostile_nvme_paths_before_measuring(tmp_path: Path, suffix: str, gib: str) -> None:
    # Four levels under a directory that does not exist: even four `..` cannot reach the (20 s) measurement.
    invoke(["probe", "--nvme-path", str(tmp_path / "missing" / "m1" / "m2" / "m3" / "m4" / suffix),
            "--nvme-test-gib", gib])


@settings(max_examples=150, **FAST)
@given(suffix=hostile_paths, value=json_values, use_suffix=st.booleans())
def test_hostile_nvme_paths(tmp_path: Path, suffix: str, value, use_suffix: bool) -> None:  # noqa: ANN001
    """In a plan and at the swap directory: refused in one line, or a private directory created
    directly inside the path it resolves to (tier names cannot leave it: test_nvme_errors.py)."""
    base = tmp_path / "a" / "b" / "c" / "d" / "e"  # `..` four times stays inside tmp_path
    base.mkdir(parents=True, exist_ok=True)
    nvme_path = str(base / suffix) if use_suffix else value
    try:
        plan = Plan.from_dict({**PLAN_DOC, "nvme_path": nvme_path})
    except PlannerError as exc:
        one_line(str(exc))
        return
    if plan.nvme_path is None:
        return
    try:
        with SwapDirectory(plan.nvme_path) as swap:
            assert swap.path.parent == Path(plan.nvme_path).expanduser().resolve()
            assert swap.path.stat().st_mode & 0o777 == 0o700
    except SwapPathError as exc:
        one_line(str(exc))


@settings(max_examples=100, **FAST)
@given(suffix=hostile_paths)
def test_hostile_checkpoint_dirs(tmp_path: Path, suffix: str) -> None:
    base = tmp_path / "a" / "b" / "c" / "d" / "e"
    base.mkdir(parents=True, exist_ok=True)
    try:
        root = check_checkpoint_dir(base / suffix)
    except PlannerError as exc:
        one_line(str(exc))
        return
    assert root.is_dir() and tmp_path in root.parents


@settings(max_examples=100, **FAST)
@given(profile=st.one_of(mutated({**PROFILE_DOC, "plan": PLAN_DOC}), json_values),
       hardware=st.one_of(st.none(), st.sampled_from(["dgx-h100", "cpu-dev-2core"]), st.text(max_size=8)))
def test_calibrate_documents(tmp_path: Path, profile, hardware) -> None:  # noqa: ANN001
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    invoke(["calibrate", str(tmp_path / "profile.json"), "--json", *(["--hardware", hardware] if hardware else [])])


@pytest.mark.parametrize("name", ["\n", "a\nb", "tab\there"])
def test_a_swap_path_with_a_newline_is_named_on_one_line(tmp_path: Path, name: str) -> None:
    """A missing nvme_path whose name holds a newline or tab (found by test_hostile_nvme_paths) is named
    quoted, with escapes, so the error stays one line."""
    with pytest.raises(SwapPathError) as caught, SwapDirectory(str(tmp_path / name)):
        pass
    message = str(caught.value)
    assert "\n" not in message and "\t" not in message
    assert repr(str(tmp_path / name)) in message and "does not exist" in message
