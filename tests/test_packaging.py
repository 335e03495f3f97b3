"""Packaging contracts: the planner stays torch-free, README and CI run the same test command."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_planner_imports_no_torch():
    code = (
        "import sys, tierwise.cli, planner.search.search, planner.cost.memory, planner.cost.throughput, planner.output.deepspeed_config, "
        "planner.search.max_size, planner.output.report; "
        "from planner.specs.catalog import resolve_model; resolve_model('1T'); "
        "bad = [m for m in ('torch', 'deepspeed', 'numpy') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def readme_commands():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```(?:bash|sh)\n(.*?)\n```", text, flags=re.S)


def test_readme_leads_with_the_two_fresh_machine_commands():
    commands = readme_commands()
    assert "planner fit 1T --gpus 16" in commands[0]
    assert "pytest" in commands[1]
    assert "torch==2.13.0" in commands[1]


def test_ci_runs_exactly_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_commands()[1].strip() in ci


def test_the_readme_command_leaves_the_slow_cases_to_ci_which_runs_them_too():
    import tomllib

    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "-m 'not slow'" in options["addopts"] and any(m.startswith("slow:") for m in options["markers"])
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    readme = next(i for i, line in enumerate(ci_lines) if line.strip() == readme_commands()[1].strip())
    readme_pytest = readme_commands()[1].rsplit("&&", 1)[1].strip()
    assert readme_pytest.startswith("python -m pytest -q")
    # After the README's command, every slow case, with the same options (workers included).
    assert f"{readme_pytest} -m slow" in ci_lines[readme + 1:]
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme_commands()[1]


def test_ruff_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
