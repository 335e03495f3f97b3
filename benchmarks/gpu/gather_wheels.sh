#!/usr/bin/env bash
# Run on a machine that reaches pip's registry, not on the GPU machine: fills DIR (default .whl/ at the
# repo root, ignored by git) with what the GPU image lacks ([Note: the GPU image] in kit.py):
#   - the wheels of kit.WHEELS, for CPython 3.12 on manylinux x86-64 (`pip download --only-binary`);
#   - DeepSpeed (kit.BUILT_WHEELS) built into a wheel from its sdist, with no ops;
#   - libaio's .debs (kit.DEBS) in DIR/deb/, for DeepSpeed's async_io op;
# then checks the folder (kit.py verify DIR: one wheel per name, every Requires-Dist covered).
#     bash benchmarks/gpu/gather_wheels.sh [DIR]
# The folder travels to the GPU machine with the repository (benchmarks/gpu/run.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-.whl}
PY=${PYTHON:-python3}
mkdir -p "$DIR/deb"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
platforms=()
for tag in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 \
           manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
mapfile -t wheels < <("$PY" benchmarks/gpu/kit.py wheels)
echo "downloading ${#wheels[@]} wheels for CPython 3.12 into $DIR" >&2
# One `pip download` per name: a name that is missing fails alone, with its name in the message.
for spec in "${wheels[@]}"; do
  name=${spec%%==*}
  norm=$(echo "$name" | tr '-' '_' | tr '[:upper:]' '[:lower:]')
  if compgen -G "$DIR/${norm}-${spec##*==}-*.whl" >/dev/null || compgen -G "$DIR/${name}-${spec##*==}-*.whl" >/dev/null; then
    continue
  fi
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$DIR" "$spec"
done
mapfile -t built < <("$PY" benchmarks/gpu/kit.py built)
for spec in "${built[@]}"; do
  if compgen -G "$DIR/${spec%%==*}-${spec##*==}-*.whl" >/dev/null; then
    continue
  fi
  start=$(date +%s)
  # No ops (they are JIT-built on the GPU with its nvcc); no build isolation: its setup.py imports
  # torch, which only the local environment has. The result is a py3-none-any wheel.
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" "$spec"
  echo "built $spec in $(( $(date +%s) - start )) s" >&2
done
mapfile -t debs < <("$PY" benchmarks/gpu/kit.py debs)
if ! compgen -G "$DIR/deb/libaio-dev_*.deb" >/dev/null; then
  (cd "$DIR/deb" && apt-get download "${debs[@]}")
fi
"$PY" benchmarks/gpu/kit.py verify "$DIR"
du -sh "$DIR" >&2
