"""benchmarks/RESULTS.md: every section is written by exactly one script, through benchmarks/results_md.py,
and no benchmark script states a fact about the machine that it did not measure there."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "RESULTS.md"
sys.path.insert(0, str(BENCHMARKS))

import results_md  # noqa: E402

SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "results_md.py") + [BENCHMARKS / "gpu" / "report.py"]
"""Every script that may write a section: benchmarks/*.py and the GPU kit's report (its `--write-results`)."""

MEASURED_ELSEWHERE = {
    "benchmarks/gpu/report.py": "its section states the GPU machine's facts, which `report.py env` measured there "
                                "and the kit's JSON carried back",
}
"""Scripts whose section's machine facts are measured on another machine, with the reason."""

FIXED_CLAIMS = ("bimodal", "shared with other", "other jobs", "dev box", "2-core", "2 cores", "2-vcpu", "project vm",
                "this vm", "virtio", "ext4", "epyc", "has no gpu")
"""Phrases that stated one development machine's facts as if true wherever a script runs."""

MACHINE_CALLS = {("os", "getloadavg"), ("os", "cpu_count"), ("socket", "gethostname"), *(
    ("platform", name) for name in ("node", "machine", "processor", "release", "python_version", "uname"))}
"""Calls that read a machine fact; only benchmarks/results_md.py makes them."""


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _write_section_calls(path: Path) -> list[ast.Call]:
    calls = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name == "write_section":
                calls.append(node)
    return calls


def _owners() -> dict[str, list[str]]:
    """Section name -> the scripts that write it (the first argument of their `write_section` calls)."""
    owners: dict[str, list[str]] = {}
    for script in SCRIPTS:
        for call in _write_section_calls(script):
            owners.setdefault(call.args[0].value, []).append(_rel(script))
    return owners


def _sections() -> dict[str, str]:
    """Section name -> its text between the markers, from RESULTS.md."""
    text = RESULTS.read_text()
    names = re.findall(r"<!-- (\S+):begin -->", text)
    assert len(names) == len(set(names)), f"a section appears twice: {sorted(n for n in names if names.count(n) > 1)}"
    sections = {}
    for name in names:
        body = re.search(rf"<!-- {re.escape(name)}:begin -->\n(.*?)\n<!-- {re.escape(name)}:end -->", text, re.S)
        assert body, f"section {name} has no end marker"
        sections[name] = body.group(1)
    return sections


def test_every_write_section_call_names_its_section_literally():
    # The ownership check reads the names from the source: a computed name would escape it.
    computed = [f"{_rel(s)}:{c.lineno}" for s in SCRIPTS for c in _write_section_calls(s)
                if not (c.args and isinstance(c.args[0], ast.Constant) and isinstance(c.args[0].value, str))]
    assert not computed, computed


def test_every_results_section_is_written_by_exactly_one_script():
    owners = _owners()
    wrong = {name: owners.get(name, []) for name in _sections() if len(owners.get(name, [])) != 1}
    assert not wrong, f"sections without exactly one writing script: {wrong}"


def test_every_heading_is_inside_a_section_and_written_by_its_owner():
    text = RESULTS.read_text()
    outside = re.sub(r"<!-- (\S+):begin -->.*?<!-- \1:end -->", "", text, flags=re.S)
    stray = [line for line in outside.splitlines() if line.startswith("#") and line != results_md.HEADER.strip()]
    assert not stray, f"headings no script writes (move hand-kept runs to docs/notes/): {stray}"
    owners = _owners()
    for name, body in _sections().items():
        heading = body.splitlines()[0]
        assert heading.startswith("## "), (name, heading)
        source = (ROOT / owners[name][0]).read_text()
        assert heading in source, f"{owners[name][0]} does not write the heading of section {name}: {heading}"


@pytest.mark.parametrize("script", SCRIPTS, ids=_rel)
def test_no_script_states_a_fixed_machine_claim(script):
    text = script.read_text().lower()
    found = [phrase for phrase in FIXED_CLAIMS if phrase in text]
    assert not found, f"{_rel(script)} states {found}: measure it with results_md.measure_machine or drop it"


@pytest.mark.parametrize("script", SCRIPTS, ids=_rel)
def test_machine_facts_come_from_the_helper(script):
    if _rel(script) in MEASURED_ELSEWHERE:
        return
    tree = ast.parse(script.read_text(), str(script))
    calls = {(n.func.value.id, n.func.attr) for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)}
    assert not calls & MACHINE_CALLS, f"{_rel(script)} reads {sorted(calls & MACHINE_CALLS)} itself"
    text = script.read_text()
    assert "/proc/cpuinfo" not in text and "findmnt" not in text, f"{_rel(script)} reads the CPU or disk itself"
    if _write_section_calls(script):  # measured now, or by the run whose recorded facts it reports
        assert "measure_machine(" in text or "MachineFacts.from_dict(" in text, \
            f"{_rel(script)} writes a section without the machine's facts from results_md"


def test_write_section_replaces_its_own_section_only(tmp_path):
    path = tmp_path / "RESULTS.md"
    results_md.write_section("a", "## A\n\none", path)
    results_md.write_section("b", "## B\n\ntwo", path)
    results_md.write_section("a", "## A\n\nthree", path)
    assert path.read_text() == ("# Benchmark results\n\n<!-- a:begin -->\n## A\n\nthree\n<!-- a:end -->\n\n"
                                "<!-- b:begin -->\n## B\n\ntwo\n<!-- b:end -->\n")


def test_machine_facts_round_trip_and_say_what_was_measured(tmp_path):
    facts = results_md.measure_machine(disk=tmp_path, versions=("pytest",)).finish()
    again = results_md.MachineFacts.from_dict(facts.to_dict())
    assert again.to_dict() == facts.to_dict()
    line = again.describe()
    assert f"{facts.cpus} CPUs" in line and facts.cpu_model in line and f"Python {facts.python}" in line
    assert f"load average {facts.load_before[0]:.2f} before / {facts.load_after[0]:.2f} after" in line
    assert f"pytest {pytest.__version__}" in line and str(tmp_path.resolve()) in line
    assert facts.torch is None and "torch" not in line  # only measured when asked for


def test_spread_is_largest_over_smallest():
    assert results_md.spread([2.0, 1.0, 4.0]) == 4.0
    assert results_md.spread([3.0]) == 1.0


def test_disk_facts_of_a_directory_not_made_yet_are_its_parents(tmp_path):
    assert results_md.DiskFacts.of(tmp_path / "made" / "later") == results_md.DiskFacts.of(tmp_path)
