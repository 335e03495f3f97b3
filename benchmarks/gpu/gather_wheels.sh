#!/usr/bin/env bash
# Run on a machine with network access (pip's registry), not on the GPU machine: fills DIR (default .whl/ at the
# repo root, ignored by git) with what the GPU image lacks ([Note: the GPU image] in kit.py):
#   - the wheels of kit.WHEELS, for CPython 3.12 on manylinux x86-64 (`pip download --only-binary`);
#   - DeepSpeed's sdist (kit.BUILT_WHEELS) in DIR/src/, from which the GPU's build stage builds its ops,
#     and a wheel of it with no ops, unless one with its ops prebuilt (from a GPU call) is there;
#   - libaio's .debs (kit.DEBS) in DIR/deb/, for DeepSpeed's async_io op;
# then checks the folder (kit.py verify DIR: one wheel per name, every Requires-Dist covered).
#     bash benchmarks/gpu/gather_wheels.sh [DIR]
#     bash benchmarks/gpu/gather_wheels.sh --built FETCHED [DIR]   # take what a call's build stage returned
# --built takes, from the files a call returned (its $OUT, copied back), the DeepSpeed wheel with its ops
# prebuilt (in place of the one without) and runtime's _aio_ext*.so (into DIR/ops/, which the install
# stage copies into runtime/): later calls carry them and build nothing ([Note: what DeepSpeed loads]
# in build_ops.py). The folder goes to the GPU machine with the repository.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILT=
if [ "${1:-}" = --built ]; then BUILT=${2:?--built needs the folder of the files a call returned}; shift 2; fi
DIR=${1:-.whl}
PY=${PYTHON:-python3}
mkdir -p "$DIR/deb" "$DIR/src" "$DIR/ops"
if [ -n "$BUILT" ]; then
  took=0
  for whl in "$BUILT"/deepspeed-*-cp312-*.whl; do
    [ -f "$whl" ] || continue
    rm -f "$DIR"/deepspeed-*.whl
    cp "$whl" "$DIR/"; took=1; echo "took $(basename "$whl") (DeepSpeed with its ops prebuilt)" >&2
  done
  for so in "$BUILT"/_aio_ext.cpython-312-*.so; do
    [ -f "$so" ] || continue
    rm -f "$DIR"/ops/_aio_ext.*.so
    cp "$so" "$DIR/ops/"; took=1; echo "took $(basename "$so") (the io_uring extension)" >&2
  done
  ((took)) || { echo "gather_wheels.sh: nothing built in $BUILT (a deepspeed-*-cp312-*.whl or _aio_ext.cpython-312-*.so)" >&2; exit 1; }
fi
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
  if ! compgen -G "$DIR/src/${spec%%==*}-${spec##*==}.tar.gz" >/dev/null; then
    "$PY" -m pip download -q --no-deps --no-binary :all: -d "$DIR/src" "$spec"
  fi
  if compgen -G "$DIR/${spec%%==*}-${spec##*==}-*.whl" >/dev/null; then
    continue
  fi
  start=$(date +%s)
  # No ops (the GPU's build stage builds them from DIR/src once); no build isolation: its setup.py
  # imports torch, which only the local environment has. The result is a py3-none-any wheel.
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" "$DIR/src/${spec%%==*}-${spec##*==}.tar.gz"
  echo "built $spec in $(( $(date +%s) - start )) s" >&2
done
mapfile -t debs < <("$PY" benchmarks/gpu/kit.py debs)
if ! compgen -G "$DIR/deb/libaio-dev_*.deb" >/dev/null; then
  (cd "$DIR/deb" && apt-get download "${debs[@]}")
fi
"$PY" benchmarks/gpu/kit.py verify "$DIR"
du -sh "$DIR" >&2
