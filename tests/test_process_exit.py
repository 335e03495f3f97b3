"""A finished rank leaves with `runtime.process_exit.leave`: exit handlers run, buffered output is
written, the exit status is kept, and the interpreter is not finalized ([Note: a rank leaves with
os._exit] in runtime/process_exit.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import atexit, sys
from pathlib import Path
from runtime.process_exit import leave

log = Path(sys.argv[1])

def note(line):
    with log.open("a") as f:
        f.write(line + "\\n")

class Finalized:
    # Module globals are cleared when the interpreter finalizes: this runs then, and only then.
    def __del__(self):
        note("finalized")

kept = Finalized()
atexit.register(note, "exit handler")
print("buffered", end="")  # stdout is a pipe here: block-buffered until flushed
if sys.argv[2] == "leave":
    leave(3)
sys.exit(3)
"""


def run(tmp_path: Path, how: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    log = tmp_path / f"{how}.log"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(log), how], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": ""}, timeout=60)
    return done, log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize(("how", "finalized"), [("sys.exit", True), ("leave", False)])
def test_leave_runs_the_exit_handlers_and_skips_only_finalization(tmp_path: Path, how: str, finalized: bool) -> None:
    done, log = run(tmp_path, how)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered"
    assert log[0] == "exit handler"
    # sys.exit is the control: it shows that the object's __del__ does run when the interpreter
    # finalizes, so its absence after leave() means finalization was skipped.
    assert ("finalized" in log) is finalized
