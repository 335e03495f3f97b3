#!/usr/bin/env bash
# The GPU kit: run the project's GPU checks and measurements on a one-GPU machine with no network
# (an H100 or H200 with a CUDA image, [Note: the GPU image] in kit.py).
#
#   bash benchmarks/gpu/run.sh --check                 # here or in CI, no GPU: verify the kit, exit 0 if complete
#   bash benchmarks/gpu/run.sh --list                  # the stages, in order
#   bash benchmarks/gpu/run.sh [--out DIR] [STAGE...]  # on the GPU machine; no STAGE: all of them
#
# Fill .whl/ with `bash benchmarks/gpu/gather_wheels.sh` on a machine that reaches pip's registry,
# copy the repository with .whl/ to the GPU machine, and run the stages there in groups (a fresh
# machine installs first; DeepSpeed's ops JIT-build on first use):
#   bash benchmarks/gpu/run.sh install build pytest parity
#   bash benchmarks/gpu/run.sh device offload
#   bash benchmarks/gpu/run.sh nvme
#   bash benchmarks/gpu/run.sh planner report
# Where the machine is held only briefly, two invocations cover the kit: `install pytest parity device
# planner staged offload` with GPUKIT_PLANNER_CHAINS=searched,zero-inf-cpu (`staged` trains the planner
# stage's CPU-tier plan 5 steps more), then `nvme`.
# An invocation ends inside CALL_BUDGET_S (590 s): each stage runs under what is left of it (at most
# STAGE_TIMEOUT_S, 570 s), and the stages that no longer fit are skipped and named. Results: each stage
# writes WORK/STAGE.json (WORK: /tmp/gpukit, kept while the machine is); after the stages,
# OUT (--out, else $OUT, else out/gpu) gets gpu-results.json (every stage so far), gpu-results.md (the
# section for benchmarks/RESULTS.md, naming the GPU) and run.log. Back in the repository, on those files:
#   python benchmarks/gpu/report.py md FILES.../gpu-results.json --write-results
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
KIT=benchmarks/gpu
PY=${PYTHON:-python3}
WORK=${GPUKIT_WORK:-/tmp/gpukit}
NVME_PATH=${GPUKIT_NVME_PATH:-/tmp/gpukit-nvme}
WHEELS=${GPUKIT_WHEELS:-$ROOT/.whl}
STAGE_TIMEOUT_S=${STAGE_TIMEOUT_S:-570}
CALL_BUDGET_S=${CALL_BUDGET_S:-590}  # the device tool's 10 minutes per command, less a margin
OUT_DIR=${OUT:-$ROOT/out/gpu}

stages=()
mode=run
while (($#)); do
  case $1 in
    --check) mode=check ;;
    --list) mode=list ;;
    --out) OUT_DIR=$2; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    -*) echo "run.sh: unknown option $1 (use --check, --list, --out DIR or stage names)" >&2; exit 2 ;;
    *) stages+=("$1") ;;
  esac
  shift
done

known_stages() { "$PY" "$KIT/kit.py" stages | cut -f1; }

check() {
  # kit.py check: the wheel list covers every third-party import, the scripts parse; here: every
  # stage kit.py lists has its function below, and this file parses.
  local summary rc missing=()
  summary=$("$PY" "$KIT/kit.py" check); rc=$?
  for s in $(known_stages); do
    declare -F "stage_$s" >/dev/null || missing+=("$s")
  done
  bash -n "$0" || rc=1
  echo "$summary"
  if ((${#missing[@]})); then
    echo "run.sh: stages without a function: ${missing[*]}" >&2
    rc=1
  fi
  echo "gpu kit check: $([ $rc = 0 ] && echo ok || echo FAILED) ($(known_stages | tr '\n' ' '))" >&2
  return $rc
}

gpu_env() {
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  export TORCH_EXTENSIONS_DIR=$WORK/torch_extensions  # DeepSpeed's JIT ops, built once per machine
  # Where pip puts console scripts (`planner`): the environment's own bin, not the interpreter's
  # resolved path (a venv's python links to the base one, whose bin holds another python).
  local bindir; bindir=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
  export PATH=$bindir:$PATH
  if [ -d "$WORK/libaio/usr/include" ]; then  # carried libaio (install stage): DeepSpeed's async_io op
    local inc=$WORK/libaio/usr/include lib=$WORK/libaio/usr/lib/x86_64-linux-gnu
    export CPATH=$inc${CPATH:+:$CPATH} LIBRARY_PATH=$lib${LIBRARY_PATH:+:$LIBRARY_PATH}
    export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} CFLAGS="-I$inc ${CFLAGS:-}" LDFLAGS="-L$lib ${LDFLAGS:-}"
  fi
}

stage_install() {
  if [ -f "$WORK/installed" ]; then echo "install: done on this machine already"; return 0; fi
  compgen -G "$WHEELS/*.whl" >/dev/null || { echo "install: no wheels in $WHEELS: run benchmarks/gpu/gather_wheels.sh where pip reaches its registry and bring .whl/ along" >&2; return 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "$WHEELS"/*.whl || return 1
  # The project itself, editable, for the `planner` console script (whatever module it points to).
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e "$ROOT" || return 1
  local libaio=system
  if [ ! -e /usr/include/libaio.h ]; then  # unpacked under WORK, never into /
    libaio=carried
    for deb in "$WHEELS"/deb/*.deb; do dpkg -x "$deb" "$WORK/libaio" || return 1; done
  fi
  gpu_env
  # JSON to a file, not stdout: DeepSpeed logs to stdout on import.
  "$PY" - "$libaio" "$WORK/install.json" <<'EOF' || return 1
import importlib, json, subprocess, sys
mods = ["simpy", "platformdirs", "typer", "rich", "yaml", "pandas", "matplotlib", "deepspeed", "streamlit", "altair",
        "torch", "transformers", "planner", "runtime"]
versions, failed = {}, {}
for m in mods:
    try:
        versions[m] = getattr(importlib.import_module(m), "__version__", "ok")
    except Exception as exc:  # every failure is reported, none stops the others
        failed[m] = f"{type(exc).__name__}: {exc}"
check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
with open(sys.argv[2], "w") as out:
    json.dump({"ok": not failed, "imports": versions, "import_errors": failed, "libaio": sys.argv[1],
               "pip_check": check.stdout.strip().splitlines()[-20:]}, out, indent=2)
EOF
  cat "$WORK/install.json"; echo
  grep -q '"ok": true' "$WORK/install.json" && touch "$WORK/installed"
}

stage_build() {
  "$PY" setup.py -q build_ext --inplace || return 1
  "$PY" - "$WORK/build.json" <<'EOF'
import json, sys, time
doc = {}
import runtime._aio_ext  # noqa: F401 - the C++ engine just built
doc["aio_ext"] = "ok"
from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
for name, builder in (("cpu_adam", CPUAdamBuilder), ("async_io", AsyncIOBuilder)):
    start = time.perf_counter()
    try:
        builder().load()
        doc[name] = {"ok": True, "jit_s": round(time.perf_counter() - start, 1)}
    except Exception as exc:  # reported; the stages that need the op say so again
        doc[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-1500:]}
doc["ok"] = all(v["ok"] for v in doc.values() if isinstance(v, dict))
with open(sys.argv[1], "w") as out:
    json.dump(doc, out, indent=2)
EOF
  cat "$WORK/build.json"; echo
}

stage_pytest() {
  local timeout=()
  # One hung test does not eat the call (GPUKIT_TEST_TIMEOUT_S seconds a test, default 300).
  "$PY" -c 'import pytest_timeout' 2>/dev/null && timeout=(--timeout "${GPUKIT_TEST_TIMEOUT_S:-300}")
  rm -f "$WORK/pytest.xml"
  "$PY" -m pytest -m gpu -q -p no:cacheprovider "${timeout[@]}" --junitxml="$WORK/pytest.xml" tests
  local rc=$?
  if [ -f "$WORK/pytest.xml" ]; then
    "$PY" "$KIT/report.py" junit "$WORK/pytest.xml" "$WORK/pytest.json"
  else
    echo "{\"ok\": false, \"error\": \"pytest exited $rc before writing its report\"}" >"$WORK/pytest.json"
  fi
  return $rc
}

stage_parity() { "$PY" "$KIT/bench_gpu.py" parity --out "$WORK/parity.json"; }
stage_device() { "$PY" "$KIT/bench_gpu.py" device --rounds 3 --steps 5 --warmup 2 --out "$WORK/device.json"; }
stage_offload() { "$PY" "$KIT/bench_gpu.py" offload --rounds 2 --steps 4 --warmup 2 --out "$WORK/offload.json"; }

stage_nvme() {
  mkdir -p "$NVME_PATH"
  "$PY" benchmarks/bench_nvme_step.py --device cuda --nvme-path "$NVME_PATH" --configs "${GPUKIT_NVME_CONFIGS:-design}" \
    --rounds 1 --steps 2 --warmup 1 --block 3 --ds-queue-depths "${GPUKIT_DS_QUEUE_DEPTHS:-16,64,128}" \
    --ds-threads "${GPUKIT_DS_THREADS:-1,8}" --sweep-steps 2 --json-out "$WORK/nvme.json" >/dev/null
}

stage_planner() {  # GPUKIT_PLANNER_CHAINS: a comma list of planner_chain.CHAINS (default all)
  "$PY" "$KIT/planner_chain.py" --work "$WORK/planner" --nvme-path "$NVME_PATH" --out "$WORK/planner.json" \
    ${GPUKIT_PLANNER_CHAINS:+--chains "$GPUKIT_PLANNER_CHAINS"} >/dev/null
}

stage_staged() {  # the planner stage's CPU-tier plan when it ran on this machine, else one fitted here
  local hw=$WORK/planner/hw.json
  [ -f "$hw" ] || hw=${GPUKIT_STAGED_HARDWARE:-h200-x1}
  local plan=$WORK/planner/plan-zero-inf-cpu.json
  [ -f "$plan" ] || plan=$WORK/staged-plan.json
  "$PY" "$KIT/staged_path.py" --plan "$plan" --hardware "$hw" --out "$WORK/staged.json"
}

stage_report() { "$PY" "$KIT/report.py" merge "$WORK" "$OUT_DIR/gpu-results.json" && "$PY" "$KIT/report.py" md "$OUT_DIR/gpu-results.json"; }

case $mode in
  check) check; exit $? ;;
  list) "$PY" "$KIT/kit.py" stages; exit 0 ;;
esac

mkdir -p "$WORK" "$OUT_DIR"
((${#stages[@]})) || mapfile -t stages < <(known_stages)
for s in "${stages[@]}"; do
  declare -F "stage_$s" >/dev/null || { echo "run.sh: unknown stage '$s' (stages: $(known_stages | tr '\n' ' '))" >&2; exit 2; }
done
[ -f "$WORK/env.json" ] || "$PY" "$KIT/report.py" env >"$WORK/env.json"
failed=() skipped=()
call_start=$(date +%s)
export ROOT KIT PY WORK NVME_PATH WHEELS OUT_DIR
for s in "${stages[@]}"; do
  if [ "$s" != install ] && [ "$s" != report ] && [ ! -f "$WORK/installed" ]; then
    stage_install 2>&1 | tee -a "$OUT_DIR/run.log" || true
  fi
  gpu_env
  # The call must end, results written, inside CALL_BUDGET_S: a stage gets what is left of it.
  left=$(( CALL_BUDGET_S - ($(date +%s) - call_start) - 20 ))
  limit=$(( left < STAGE_TIMEOUT_S ? left : STAGE_TIMEOUT_S ))
  if ((limit < 30)); then skipped+=("$s"); continue; fi
  # A JIT build killed by a stage's time limit leaves its lock, on which every later build would
  # wait for ever; stages run one at a time, so any lock found here is such a leftover.
  find "$TORCH_EXTENSIONS_DIR" -maxdepth 2 -name lock -type f -delete 2>/dev/null
  echo "== stage $s: $(date -u +%H:%M:%S), limit ${limit} s" | tee -a "$OUT_DIR/run.log"
  start=$(date +%s)
  # Each stage in its own shell under its time limit; its output goes to the log and the terminal.
  timeout "$limit" bash -c "$(declare -f stage_"$s" gpu_env); gpu_env; stage_$s" 2>&1 | tee -a "$OUT_DIR/run.log"
  rc=${PIPESTATUS[0]}
  echo "== stage $s: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$OUT_DIR/run.log"
  ((rc == 0)) || failed+=("$s")
done
"$PY" "$KIT/report.py" merge "$WORK" "$OUT_DIR/gpu-results.json"
"$PY" "$KIT/report.py" md "$OUT_DIR/gpu-results.json" >"$OUT_DIR/gpu-results.md"
if ((${#skipped[@]})); then echo "run.sh: skipped, the call's time was spent: ${skipped[*]} (run them in another call)" | tee -a "$OUT_DIR/run.log" >&2; fi
if ((${#failed[@]} + ${#skipped[@]})); then echo "run.sh: failed stages: ${failed[*]:-none}" >&2; exit 1; fi
