"""The repository stands alone, and its source notes state invariants (docs/conventions.md).

- Nothing outside docs/notes/ (dated lab notes, kept as written) cites notes the repository does not
  carry or a tracker's issue numbers, and no text describes where the project is built: a fact is
  written as the fact, a reference points at a file in the repository.
- No module docstring is over 25 lines: it says what the module is for and what it guarantees;
  longer reasoning goes into named `[Note: ...]` blocks beside the code it explains.
- No source comment or docstring carries a dated or machine-specific measurement. Such numbers live
  in benchmarks/RESULTS.md and docs/notes/, and the source points there. The pattern: a date; in
  product code a number with a rate or time unit (GB/s, G elements/s, TFLOPS, ms, us) or a measured
  speed-up ("3x faster"); anywhere a number with a unit after "measured", "took", "ran", "reached"
  in the same sentence. A test's comments may define its inputs with units (a round-number node of
  10 GB/s links), so tests are held to the date and sentence rules only. `ALLOWED` lists the few
  definitions and citations of published numbers the pattern would otherwise catch.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAB_NOTES = "docs/notes/"
MAX_MODULE_DOCSTRING_LINES = 25

CITATION = re.compile(r"DESIGN\.md|STYLE\.md|\.\./shared|/work/share[d]|\bissues? [0-9]+", re.IGNORECASE)
"""Notes kept outside the repository, and a tracker's numbers (a public project's `issue #N` is a citation)."""
WHERE_BUILT = re.compile(
    r"workplace|\b(?:our|the project's|project|dev|development) (?:vm|box|machine)s?\b|dev-box|/work/|bench\.lock"
    r"|device README|KINDS\.md|\blent machines?\b", re.IGNORECASE)
"""Phrases that describe where the project is built rather than the hardware a text is about."""
PHRASE_LISTS = ("tests/test_planner_presets.py", "tests/test_results_md.py", "tests/test_source_notes.py")
"""Tests that hold such phrases as data, to assert their absence elsewhere."""

DATE = re.compile(r"(?<![\w/-])20\d\d-[01]\d-[0-3]\d(?![\w-])")
"""A date; a docs/notes/ file name (`docs/notes/2026-11-26-first-gpu-run.md`) is a pointer, not a date."""
RATE_OR_TIME = re.compile(
    r"\b\d+(?:\.\d+)?\s?(?:[GMKT]i?B/s|G ?(?:elements|params|flop)/s|Gparams/s|T?FLOPS|TFLOP/s|GFLOP/s|ms|us|µs|s/step)\b"
    r"|\b\d+(?:\.\d+)?x (?:faster|slower)\b")
MEASURED = re.compile(
    r"\b(?:measured|took|ran|reached)\b[^.;:]{0,40}?\b\d+(?:\.\d+)?\s?"
    r"(?:[GMKT]i?B/s|[GMKT]i?B|G ?(?:elements|params|flop)/s|Gparams/s|T?FLOPS|TFLOP/s|GFLOP/s|ms|us|µs|s|s/step)\b")
ALLOWED: dict[str, tuple[str, ...]] = {
    # NCCL's own latencies (src/graph/tuning.cc) and nccl-tests' published bus bandwidths across DGX nodes
    "planner/cost/collectives.py": (
        "180-190 GB/s on DGX A100 (8 x HDR 200 Gb/s = 200 GB/s) and 350-390 GB/s on DGX H100 (8 x NDR 400 Gb/s = 400 GB/s), "
        "not one NIC's 25 or 50 GB/s", "base 8.4 us, 3.4 us per NVLink step, 5.7 us per PCIe step, 14 us per network step"),
    # FlashAttention-2/3's published rates and the V100 microbenchmark's global-memory throughput
    "planner/cost/kernels.py": ("the A100's 312 TFLOPS", "take the low end, 156 TFLOPS", "abstract: 346 TFLOPS",
                                "the published 750 of 900 GB/s"),
    # the hand-set prior: the paper's and FlashAttention's published numbers
    "planner/validation/fit.py": ("the paper's 70 of 125 TFLOPS", "FlashAttention-2's published 156 TFLOPS"),
    # a definition: the probe's sampling interval
    "runtime/memory_probe.py": ("sampled every 0.5 ms",),
}


def _tracked() -> list[str]:
    """The repository's files: git's list in a checkout, else every file under the source folders."""
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        files = out.split()
    except (OSError, subprocess.CalledProcessError):
        files = []
    if not files:
        tops = ("planner", "runtime", "app", "tierwise", "csrc", "benchmarks", "tests", "docs", "data")
        files = [str(p.relative_to(ROOT)) for top in tops for p in (ROOT / top).rglob("*") if p.is_file()]
        files += [f for f in ("README.md", "setup.py", "pyproject.toml") if (ROOT / f).exists()]
    return sorted(f for f in files if (ROOT / f).is_file() and "__pycache__" not in f)


FILES = _tracked()
TEXT_SUFFIXES = (".py", ".md", ".json", ".toml", ".sh", ".cpp", ".h", ".txt", ".yaml", ".yml", ".csv", ".cfg")
PYTHON = [f for f in FILES if f.endswith(".py")]


def _text_files() -> list[str]:
    return [f for f in FILES if f.endswith(TEXT_SUFFIXES) and not f.startswith(LAB_NOTES)]


def test_nothing_cites_notes_outside_the_repository_or_a_tracker():
    found = [f"{f}:{n}: {line.strip()[:120]}" for f in _text_files()
             for n, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1) if CITATION.search(line)]
    assert not found, "cite a file in the repository, or write the fact itself:\n" + "\n".join(found)


def test_no_text_describes_where_the_project_is_built():
    found = [f"{f}:{n}: {line.strip()[:120]}" for f in _text_files() if f not in PHRASE_LISTS
             for n, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1) if WHERE_BUILT.search(line)]
    assert not found, "describe the hardware, not where the project is built:\n" + "\n".join(found)


def _module_docstring_lines(path: str) -> int:
    doc = ast.get_docstring(ast.parse((ROOT / path).read_text(), filename=path), clean=False)
    return 0 if doc is None else len(doc.strip("\n").splitlines())


def test_no_module_docstring_over_25_lines():
    long = {f: n for f in PYTHON if (n := _module_docstring_lines(f)) > MAX_MODULE_DOCSTRING_LINES}
    assert not long, f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines (move the reasoning into [Note: ...] blocks): {long}"


def _notes(path: str) -> list[tuple[int, str]]:
    """(first line, text) of every docstring, attribute docstring and run of comment lines of `path`."""
    source = (ROOT / path).read_text()
    if path.endswith(".py"):
        out = [(node.value.lineno, node.value.value) for node in ast.walk(ast.parse(source, filename=path))
               if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)]
        comments = [(tok.start[0], tok.string.lstrip("#").strip())
                    for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT]
    else:  # C++: // comments (the extension's sources use no block comments for prose)
        comments = [(n, line.split("//", 1)[1].strip()) for n, line in enumerate(source.splitlines(), 1) if "//" in line]
        out = []
    block: list[tuple[int, str]] = []
    for line, text in comments:  # consecutive comment lines read as one text, so a sentence may span them
        if block and line != block[-1][0] + 1:
            out.append((block[0][0], " ".join(t for _, t in block)))
            block = []
        block.append((line, text))
    if block:
        out.append((block[0][0], " ".join(t for _, t in block)))
    return out


def _measurements(path: str, text: str) -> list[str]:
    flat = " ".join(text.split())
    found = [*DATE.finditer(flat), *MEASURED.finditer(flat)]
    if not path.startswith("tests/"):
        found += RATE_OR_TIME.finditer(flat)
    allowed = [(m.start(), m.end()) for phrase in ALLOWED.get(path, ()) for m in re.finditer(re.escape(phrase), flat)]
    return [m.group(0) for m in found if not any(a <= m.start() and m.end() <= b for a, b in allowed)]


SOURCES = [f for f in FILES if f.endswith(".py") or f.startswith("csrc/")]


def test_no_source_note_carries_a_dated_or_machine_specific_measurement():
    found = [f"{f}:{line}: {hit}" for f in SOURCES for line, text in _notes(f) for hit in _measurements(f, text)]
    assert not found, ("measurements belong in benchmarks/RESULTS.md or a dated note in docs/notes/ (leave a "
                       "one-line pointer):\n" + "\n".join(found))


@pytest.mark.parametrize(("text", "caught"), [
    ("on a 2-vCPU VM it ran at 0.77 G elements/s at 8 Mi elements", True),
    ("measured 2026-11-26 on an H200", True),
    ("the step took 0.443 s, not the 0.184 s that rate predicts", True),
    ("1.32x faster than torch's add", True),
    ("see docs/notes/2026-11-26-first-gpu-run.md for the numbers", False),
    ("a bubble of (p - 1) / m of the useful work", False),
])
def test_the_measurement_pattern(text, caught):
    assert bool(_measurements("planner/example.py", text)) == caught

