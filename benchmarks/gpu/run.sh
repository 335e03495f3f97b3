#!/usr/bin/env bash
# The GPU kit: the offload tiers first, then the checks, the planner and the traces, in ONE call of at
# most CALL_BUDGET_S seconds (default 420) on a fresh one-GPU machine with no network. docs/gpu.md
# says how to run it and what each stage shows; kit.py's STAGES is the plan ([Note: sizing the call]).
#
#   bash benchmarks/gpu/run.sh --check                 # any machine or CI, no GPU: verify the kit, exit 0 if complete
#   bash benchmarks/gpu/run.sh --list                  # the stages, in order, with their planned seconds
#   bash benchmarks/gpu/run.sh --dry-run [STAGE...]    # no GPU: the same call on the emulated device, tiny sizes
#   bash benchmarks/gpu/run.sh [--ds-sweep] [--out DIR] [STAGE...]   # on the GPU machine; no STAGE: all of them
#
# First, on a machine with network access: `bash benchmarks/gpu/gather_wheels.sh` (and `--built DIR`
# with the files a call returned, so that DeepSpeed's ops and the io_uring extension built there travel
# from then on). Then copy the repository with .whl/ to the GPU machine and run, under a 450 s limit:
#   CALL_BUDGET_S=420 bash benchmarks/gpu/run.sh
# Order: install, build, offload, nvme, pytest, parity, device, planner, staged. Each stage runs under
# what is left of CALL_BUDGET_S (benchmarks/gpu/call.py), the build under what install, offload and nvme
# leave it; one that no longer fits is skipped and named, with the command of the call that runs it.
# Results land in OUT (--out, else $OUT, else out/gpu; out/gpu-dry for a dry run) as each stage ends:
# gpu-results.json, gpu-results.md (the section for benchmarks/RESULTS.md, must-shows met / not met),
# run.log, and what `build` built (a DeepSpeed wheel with its ops, runtime/_aio_ext*.so). Back on the
# machine with network access:
#   python benchmarks/gpu/report.py md FILES.../gpu-results.json --write-results
set -uo pipefail
export GPUKIT_CALL_START=${GPUKIT_CALL_START:-$(date +%s)}  # the call's budget counts from here (call.py)
cd "$(dirname "$0")/../.."
ROOT=$PWD
KIT=benchmarks/gpu
DRY=${GPUKIT_DRY_RUN:-0}
OUT_DIR=${GPUKIT_OUT:-${OUT:-}}
stages=()
mode=run
stage=
while (($#)); do
  case $1 in
    --check) mode=check ;;
    --list) mode=list ;;
    --dry-run) DRY=1 ;;
    --ds-sweep) export GPUKIT_DS_SWEEP=1 ;;
    --out) OUT_DIR=$2; shift ;;
    --stage) mode=stage; stage=$2; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    -*) echo "run.sh: unknown option $1 (use --check, --list, --dry-run, --ds-sweep, --out DIR or stage names)" >&2; exit 2 ;;
    *) stages+=("$1") ;;
  esac
  shift
done
if [ "$DRY" = 1 ]; then
  [ -x "$ROOT/.venv/bin/python" ] && PY=${PYTHON:-$ROOT/.venv/bin/python} || PY=${PYTHON:-python3}
  WORK=${GPUKIT_WORK:-/tmp/gpukit-dry}
  OUT_DIR=${OUT_DIR:-$ROOT/out/gpu-dry}
  PROFILE=dry
else
  PY=${PYTHON:-python3}
  WORK=${GPUKIT_WORK:-/tmp/gpukit}
  OUT_DIR=${OUT_DIR:-$ROOT/out/gpu}
  PROFILE=gpu
fi
NVME_PATH=${GPUKIT_NVME_PATH:-$WORK/nvme}
WHEELS=${GPUKIT_WHEELS:-$ROOT/.whl}
SITE=$WORK/site  # a DeepSpeed built by the build stage (pip --target): never the environment's own
export GPUKIT_DRY_RUN=$DRY GPUKIT_WORK=$WORK GPUKIT_OUT=$OUT_DIR

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
  export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  export TORCH_EXTENSIONS_DIR=$WORK/torch_extensions  # DeepSpeed's JIT cache: unused once its ops are prebuilt
  if [ "$DRY" = 1 ]; then
    # DeepSpeed's setup.py builds async_io for its CPU accelerator with the CUDA op's builder, whose
    # link flags without CUDA leave out -laio (the CPU builder's JIT flags have it): the prebuilt op
    # then lacks io_submit. The GPU build links it; the dry run preloads libaio.
    export DS_ACCELERATOR=cpu LD_PRELOAD=libaio.so.1${LD_PRELOAD:+:$LD_PRELOAD}
  fi
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

import_check() {  # JSON to a file, not stdout: DeepSpeed logs to stdout on import
  "$PY" - "$1" "$WORK/install.json" "$DRY" <<'EOF'
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
               "dry_run": sys.argv[3] == "1", "pip_check": check.stdout.strip().splitlines()[-20:]}, out, indent=2)
EOF
  cat "$WORK/install.json"; echo
  grep -q '"ok": true' "$WORK/install.json"
}

stage_install() {
  if [ "$DRY" = 1 ]; then import_check system; return; fi  # the dry run's environment is the one it runs in
  if [ -f "$WORK/installed" ]; then echo "install: done on this machine already"; cat "$WORK/install.json"; return 0; fi
  compgen -G "$WHEELS/*.whl" >/dev/null || { echo "install: no wheels in $WHEELS: run benchmarks/gpu/gather_wheels.sh on a machine with network access and copy .whl/ here with the repository" >&2; return 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "$WHEELS"/*.whl || return 1
  # The project itself, editable, for the `planner` console script (whatever module it points to).
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e "$ROOT" || return 1
  # The io_uring extension a build stage returned (gather_wheels.sh --built): the build stage then only checks it.
  local ext; for ext in "$WHEELS"/ops/_aio_ext.*.so; do [ -f "$ext" ] && cp "$ext" "$ROOT/runtime/"; done
  local libaio=system
  if [ ! -e /usr/include/libaio.h ]; then  # unpacked under WORK, never into /
    libaio=carried
    for deb in "$WHEELS"/deb/*.deb; do dpkg -x "$deb" "$WORK/libaio" || return 1; done
  fi
  gpu_env
  import_check "$libaio" && touch "$WORK/installed"
}

stage_build() {
  "$PY" "$KIT/build_ops.py" --wheels "$WHEELS" --work "$WORK" --out "$OUT_DIR" --site "$SITE" --json "$WORK/build.json"
}

stage_offload() {  # on the GPU DeepSpeed's ops are the build stage's, never compiled here ([Note: DeepSpeed's ops are the build stage's] in bench_llama.py)
  local opts=(--profile "$PROFILE" --out "$WORK/offload.json")
  [ "$DRY" = 1 ] || opts+=(--require-prebuilt)
  "$PY" "$KIT/bench_llama.py" offload "${opts[@]}"
}

stage_nvme() {
  local opts=(--profile "$PROFILE" --nvme-path "$NVME_PATH" --out "$WORK/nvme.json")
  [ "$DRY" = 1 ] || opts+=(--require-prebuilt)
  [ -n "${GPUKIT_DS_SWEEP:-}" ] && opts+=(--sweep)
  [ -n "${GPUKIT_DS_AIO:-}" ] && opts+=(--ds-aio "$GPUKIT_DS_AIO")
  "$PY" "$KIT/bench_llama.py" nvme "${opts[@]}"
}

stage_planner() {  # GPUKIT_PLANNER_CHAINS: a comma list of planner_chain.CHAINS (default all, in order)
  local hw=(); [ "$DRY" = 1 ] && hw=(--hardware cpu-dev-2core)  # the probe takes minutes on a small CPU machine
  "$PY" "$KIT/planner_chain.py" --work "$WORK/planner" --nvme-path "$NVME_PATH" --profile "$PROFILE" "${hw[@]}" \
    --out "$WORK/planner.json" ${GPUKIT_PLANNER_CHAINS:+--chains "$GPUKIT_PLANNER_CHAINS"} >/dev/null
}

stage_staged() {  # the planner stage's host-memory plan when it ran on this machine, else one fitted here
  local hw=$WORK/planner/hw.json plan=$WORK/planner/plan-cpu.json model=()
  [ -f "$hw" ] || hw=${GPUKIT_STAGED_HARDWARE:-$([ "$DRY" = 1 ] && echo cpu-dev-2core || echo h200-x1)}
  if [ -f "$plan" ]; then model=(--model "$WORK/planner/model-offload-$PROFILE.json"); else plan=$WORK/staged-plan.json; rm -f "$plan"; fi
  local micro=(); [ "$DRY" = 1 ] && micro=(--unit-numel 65536 --units 3 --steps 3)
  "$PY" "$KIT/staged_path.py" --plan "$plan" "${model[@]}" --hardware "$hw" --profile "$PROFILE" "${micro[@]}" \
    --out "$WORK/staged.json"
}

stage_pytest() {
  local timeout=()
  # One hung test does not eat the call (GPUKIT_TEST_TIMEOUT_S seconds a test, default 120).
  "$PY" -c 'import pytest_timeout' 2>/dev/null && timeout=(--timeout "${GPUKIT_TEST_TIMEOUT_S:-120}")
  rm -f "$WORK/pytest.xml"
  "$PY" -m pytest -m gpu -q -p no:cacheprovider "${timeout[@]}" --junitxml="$WORK/pytest.xml" tests
  local rc=$?
  if [ -f "$WORK/pytest.xml" ]; then  # a dry run has no CUDA: every gpu test is skipped, which is no failure there
    "$PY" "$KIT/report.py" junit "$WORK/pytest.xml" "$WORK/pytest.json" $([ "$DRY" = 1 ] && echo --no-gpu)
  else
    echo "{\"ok\": false, \"error\": \"pytest exited $rc before writing its report\"}" >"$WORK/pytest.json"
  fi
  return $rc
}

stage_parity() {
  local dry=(); [ "$DRY" = 1 ] && dry=(--device cpu --size tiny)
  "$PY" "$KIT/bench_gpu.py" parity "${dry[@]}" --out "$WORK/parity.json"
}

stage_device() {
  local dry=(); [ "$DRY" = 1 ] && dry=(--device cpu --size tiny)
  "$PY" "$KIT/bench_gpu.py" device --rounds 2 --steps 4 --warmup 2 "${dry[@]}" --out "$WORK/device.json"
}

case $mode in
  check) check; exit $? ;;
  list) "$PY" - "$KIT" <<'EOF'
import sys
sys.path.insert(0, sys.argv[1])
import kit
for name, s in kit.STAGES.items():
    kept = "; reserved: the stages before it that are not leave it these seconds" if s.reserved else ""
    print(f"{name}\t{s.h200_s} s on an H200 (starts with {s.min_s} s left, at most {s.cap_s} s{kept})\t{s.what}")
print(f"call budget: CALL_BUDGET_S, default {kit.CALL_BUDGET_S} s")
EOF
    exit 0 ;;
  stage)
    declare -F "stage_$stage" >/dev/null || { echo "run.sh: unknown stage '$stage'" >&2; exit 2; }
    mkdir -p "$WORK"; gpu_env; "stage_$stage"; exit $? ;;
esac

mkdir -p "$WORK" "$OUT_DIR"
for s in "${stages[@]}"; do
  declare -F "stage_$s" >/dev/null || { echo "run.sh: unknown stage '$s' (stages: $(known_stages | tr '\n' ' '))" >&2; exit 2; }
done
rm -f "$OUT_DIR"/gpu-results.json "$OUT_DIR"/gpu-results.md "$OUT_DIR"/run.log  # one call, one set of results
rm -f "$WORK"/{offload,nvme,planner,staged,pytest,parity,device,build}.json  # a stage's JSON is this call's
[ -f "$WORK/env.json" ] || PYTHONPATH=$ROOT "$PY" "$KIT/report.py" env >"$WORK/env.json"
"$PY" "$KIT/report.py" publish "$OUT_DIR" env "$WORK/env.json"
export GPUKIT_STAGE_CMD="bash $ROOT/$KIT/run.sh --stage"
exec "$PY" "$KIT/call.py" "${stages[@]}"
