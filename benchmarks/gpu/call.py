"""The GPU kit's one call: the stages of kit.STAGES in order, each under what is left of the caller's
budget, every result merged into OUT the moment it exists (run.sh calls this; standard library only,
so it runs before the install stage).

    python benchmarks/gpu/call.py [STAGE...]

Environment (run.sh sets it): CALL_BUDGET_S, the seconds the whole call may take (default
kit.CALL_BUDGET_S), counted from GPUKIT_CALL_START (run.sh's start); GPUKIT_WORK, the stages' work
folder; GPUKIT_OUT, the results folder; GPUKIT_STAGE_CMD, the command a stage name is appended to
(`bash benchmarks/gpu/run.sh --stage`).

[Note: results survive a cut]
The device returns what is under OUT when its command ends, also when it is killed at its time
limit. So nothing waits for the end: the log goes to OUT/run.log line by line, and after each stage
(and, from inside the stage, after each shape the offload and nvme stages measure) the stage's JSON
is merged into OUT/gpu-results.json and OUT/gpu-results.md is written again (report.publish). A stage
is started only when at least its `min_s` is left, and runs at most until the call's budget (less
kit.FINISH_MARGIN_S, and for a stage that is not `reserved` less the planned seconds of the reserved
stages after it) or its `cap_s`; `GPUKIT_DEADLINE` (seconds since the epoch) tells it when it
will be stopped, so that it can leave out a shape it has no time for and say so. The stages left
out are named in the log, in the `kit` entry of the results and on the last line.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import kit
import report

KILL_GRACE_S = 5
"""After SIGTERM at a stage's limit, the seconds its process group has before SIGKILL."""


def call_budget_s(environ: dict[str, str]) -> float:
    """The call's budget from the caller (CALL_BUDGET_S), else kit.CALL_BUDGET_S; a bad value is one line."""
    raw = environ.get("CALL_BUDGET_S", "").strip()
    if not raw:
        return float(kit.CALL_BUDGET_S)
    try:
        value = float(raw)
    except ValueError:
        raise SystemExit(f"call.py: CALL_BUDGET_S={raw!r} is not a number of seconds; set e.g. CALL_BUDGET_S=420") from None
    if value <= kit.FINISH_MARGIN_S:
        raise SystemExit(f"call.py: CALL_BUDGET_S={raw} leaves no time for a stage; give more than {kit.FINISH_MARGIN_S} s")
    return value


class Log:
    """OUT/run.log and stdout, line by line, flushed at once (a cut loses nothing written)."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("a", buffering=1)
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        with self._lock:
            self._file.write(text + "\n")
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

    def close(self) -> None:
        self._file.close()


def run_stage(cmd: list[str], limit_s: float, env: dict[str, str], log: Log) -> tuple[int | None, float]:
    """Run `cmd` in its own process group for at most `limit_s`, its output to the log; (exit code or
    None when it was stopped at its limit, seconds)."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, bufsize=1)
    reader = threading.Thread(target=lambda: [log.line(line.rstrip("\n")) for line in proc.stdout], daemon=True)
    reader.start()
    try:
        code: int | None = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        code = None
        for sig, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        proc.wait()
    reader.join(timeout=5)
    return code, time.monotonic() - start


def clear_stale_build_locks(work: Path) -> list[str]:
    """The lock files of torch's extension builds under WORK/torch_extensions (DeepSpeed's JIT cache),
    removed after a stage was stopped: a build killed with its stage leaves its `lock`, and the next
    process that loads that extension waits on it for ever (a dry run's first DeepSpeed stage
    JIT-builds the CPU accelerator's shm_comm op). Returns the extensions whose lock went."""
    gone = []
    for lock in sorted((work / "torch_extensions").glob("*/lock")):
        lock.unlink(missing_ok=True)
        gone.append(lock.parent.name)
    return gone


def stage_doc(work: Path, stage: str, code: int | None, seconds: float) -> dict:
    """The stage's own JSON (WORK/STAGE.json), or a document saying why there is none."""
    path = work / f"{stage}.json"
    doc: dict
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        doc = {"ok": False, "no_result": True,
               "error": f"no result: the stage {'was stopped at its limit' if code is None else f'exited {code}'} "
                        f"after {seconds:.0f} s without writing {path.name}"}
    except json.JSONDecodeError as exc:
        doc = {"ok": False, "error": f"unreadable {path.name}: {exc}"}
    if code is None and not doc.get("partial"):
        doc = {**doc, "ok": False, "partial": True}
    return doc


def kept_for(later: list[str]) -> dict[str, int]:
    """The reserved stages among `later` -> their planned seconds, which a stage that is not reserved
    leaves them ([Note: sizing the call] in kit.py)."""
    return {s: kit.STAGES[s].h200_s for s in later if kit.STAGES[s].reserved}


def _kept(kept: dict[str, int]) -> str:
    return f" ({sum(kept.values())} s kept for {' '.join(kept)})" if kept else ""


def next_call(skipped: list[str]) -> str:
    """The command of the call that runs what this one skipped; install first (seconds where it is
    done already, and needed on a fresh machine)."""
    return "bash benchmarks/gpu/run.sh " + " ".join(["install", *(s for s in skipped if s != "install")])


def plan(stages: list[str], budget_s: float, environ: dict[str, str]) -> dict:
    return {"budget_s": budget_s, "stages": stages, "dry_run": environ.get("GPUKIT_DRY_RUN") == "1",
            "expected_h200_s": {s: kit.STAGES[s].h200_s for s in stages}, "ran": {}, "skipped": []}


def run_call(stages: list[str], budget_s: float, work: Path, out: Path, stage_cmd: list[str],
             environ: dict[str, str], clock=time.monotonic, spent_s: float = 0.0) -> dict:  # noqa: ANN001 - () -> float
    """Every stage in order under what is left of `budget_s`, of which `spent_s` went before (run.sh's
    own start); returns the `kit` record (also in OUT)."""
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "run.log")
    record = plan(stages, budget_s, environ)
    start = clock() - spent_s
    try:
        for i, stage in enumerate(stages):
            spec = kit.STAGES[stage]
            kept = kept_for(stages[i + 1:]) if not spec.reserved else {}
            left = budget_s - (clock() - start) - kit.FINISH_MARGIN_S - sum(kept.values())
            if left < spec.min_s:
                record["skipped"].append(stage)
                log.line(f"== stage {stage}: skipped, {max(left, 0):.0f} s left of the call{_kept(kept)} and it needs "
                         f"{spec.min_s} s")
                report.publish(out, "kit", record)
                continue
            cap = spec.dry_cap_s if record["dry_run"] and spec.dry_cap_s else spec.cap_s
            limit = min(left, cap)
            env = {**environ, "GPUKIT_DEADLINE": f"{time.time() + limit:.0f}", "GPUKIT_STAGE": stage}
            log.line(f"== stage {stage}: {time.strftime('%H:%M:%S', time.gmtime())} UTC, limit {limit:.0f} s{_kept(kept)} "
                     f"(expected on an H200: {spec.h200_s} s)")
            code, seconds = run_stage([*stage_cmd, stage], limit, env, log)
            doc = stage_doc(work, stage, code, seconds)
            status = "stopped at its limit" if code is None else "ok" if code == 0 and doc.get("ok") else "failed"
            record["ran"][stage] = {"status": status, "exit": code, "seconds": round(seconds, 1)}
            log.line(f"== stage {stage}: {status} (exit {code}) after {seconds:.0f} s")
            if code is None and (unlocked := clear_stale_build_locks(work)):
                log.line(f"== stage {stage}: removed the lock its killed build left on {' '.join(unlocked)}")
            report.publish(out, stage, doc)
            report.publish(out, "kit", record)
    finally:
        record["elapsed_s"] = round(clock() - start, 1)
        report.publish(out, "kit", record)
        if record["skipped"]:
            log.line(f"run.sh: skipped, the call's budget of {budget_s:.0f} s was spent: {' '.join(record['skipped'])} "
                     f"(another call: {next_call(record['skipped'])})")
        failed = [s for s, r in record["ran"].items() if r["status"] != "ok"]
        log.line(f"run.sh: {len(record['ran'])} stage(s) ran in {record['elapsed_s']:.0f} s of {budget_s:.0f} s; "
                 f"failed: {' '.join(failed) or 'none'}; skipped: {' '.join(record['skipped']) or 'none'}")
        log.close()
    return record


def main(argv: list[str]) -> int:
    stages = argv or list(kit.STAGES)
    unknown = [s for s in stages if s not in kit.STAGES]
    if unknown:
        print(f"call.py: unknown stage(s) {' '.join(unknown)} (stages: {' '.join(kit.STAGES)})", file=sys.stderr)
        return 2
    environ = dict(os.environ)
    budget = call_budget_s(environ)
    work = Path(environ.get("GPUKIT_WORK", "/tmp/gpukit"))
    out = Path(environ.get("GPUKIT_OUT") or environ.get("OUT") or kit.ROOT / "out" / "gpu")
    stage_cmd = shlex.split(environ.get("GPUKIT_STAGE_CMD", f"bash {kit.KIT / 'run.sh'} --stage"))
    # The budget counts from run.sh's start (GPUKIT_CALL_START, seconds since the epoch), not this one's.
    spent = max(0.0, time.time() - float(environ.get("GPUKIT_CALL_START", time.time())))
    record = run_call(stages, budget, work, out, stage_cmd, environ, spent_s=spent)
    bad = record["skipped"] or [s for s, r in record["ran"].items() if r["status"] != "ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
