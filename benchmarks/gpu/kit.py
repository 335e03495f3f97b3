"""The GPU kit's one source of truth: what the GPU image holds, what travels as wheels, the stages of
`run.sh`, and the check that the kit is complete (`run.sh --check`, run in CI without a GPU).

    python benchmarks/gpu/kit.py check      # JSON summary; exit 1 when the kit is incomplete
    python benchmarks/gpu/kit.py wheels     # NAME==VERSION per line, for gather_wheels.sh
    python benchmarks/gpu/kit.py stages     # STAGE<TAB>what it does, in run order

[Note: the GPU image]
The GPU machine the kit is for runs Python 3.12 from a CUDA image ('cuda') and reaches no network:
IMAGE_PACKAGES is that image's package list. Whatever the project imports that is not there travels
as a wheel in `.whl/`, which gather_wheels.sh fills on a machine that reaches pip's registry and the
run takes along. Versions are the ones this project's venv runs its tests with,
so the GPU machine runs the same code paths. Two of them are in the image too but travel anyway,
because our wheels need newer versions than the image may hold: typing-extensions
(pydantic 2.14 needs >= 4.16) and narwhals (altair 6.3 needs >= 2.4). DeepSpeed has no wheel on PyPI:
its sdist travels (`.whl/src/`), with a wheel built from it here with no ops (DS_BUILD_OPS=0); the
GPU machine's build stage builds its ops (cpu_adam, async_io, pin_memory) into a wheel there once
and returns it, and `gather_wheels.sh --built` puts it in place of the one without
([Note: what DeepSpeed loads] in build_ops.py), with the io_uring extension it built (`.whl/ops/`).
Its NVMe op needs libaio, which the image may lack: libaio1 and libaio-dev travel as .debs,
unpacked under /tmp, never into /.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
KIT = Path(__file__).resolve().parent

_IMAGE_LIST = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning
pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers
toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
"""
IMAGE_PACKAGES = frozenset(_IMAGE_LIST.split())
"""The GPU image's distributions ([Note: the GPU image])."""

WHEELS = {
    # the planner's own needs (pyproject dependencies)
    "simpy": "4.1.2", "platformdirs": "4.14.8",
    # DeepSpeed's pure-Python needs absent from the image (its Requires-Dist: einops hjson msgpack ninja
    # numpy packaging psutil py-cpuinfo pydantic torch tqdm)
    "hjson": "3.1.0", "pydantic": "2.14.4", "pydantic-core": "2.50.5", "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5", "typing-extensions": "4.16.0",
    # the dashboard (app/, and tests/test_app_*.py, which pytest collects even under `-m gpu`)
    "streamlit": "1.67.0", "altair": "6.3.0", "narwhals": "2.29.0", "jsonschema": "4.26.0",
    "jsonschema-specifications": "2025.9.1", "referencing": "0.37.0", "rpds-py": "2026.9.1", "pydeck": "0.9.3",
    "starlette": "1.10.0", "uvicorn": "0.54.0", "python-multipart": "0.0.34", "websockets": "17.4",
    "itsdangerous": "2.2.0", "watchdog": "7.1.0",
}
"""Distribution -> version, downloaded as manylinux x86-64 / py3 wheels for CPython 3.12."""

BUILT_WHEELS = {"deepspeed": "0.19.8"}
"""Built here from the sdist (`DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation`), whose file
travels too (`src/NAME-VERSION.tar.gz`): the GPU's build stage builds the ops from it."""
GPU_PYTHON_TAG = "cp312"
"""What the GPU image's Python builds: a built wheel or extension of another tag is from elsewhere."""

DEBS = ("libaio1", "libaio-dev")
"""System packages for DeepSpeed's async_io op, unpacked under /tmp on the GPU machine when absent."""

IMPORT_NAMES = {"yaml": "pyyaml", "PIL": "pillow", "google": "protobuf", "cpuinfo": "py-cpuinfo",
                "pydantic_core": "pydantic-core", "multipart": "python-multipart", "jsonschema_specifications":
                "jsonschema-specifications", "rpds": "rpds-py", "typing_extensions": "typing-extensions",
                "attr": "attrs", "dateutil": "python-dateutil", "pynvml": "nvidia-ml-py"}
"""Import name -> distribution, where they differ (otherwise `_` becomes `-`)."""

OPTIONAL_IMPORTS = {"selenium": "tests/test_app_browser.py imports it inside its test, which needs Chromium "
                                "and is not a gpu test: `pytest -m gpu` deselects it before it runs"}
"""Imports the GPU runs never execute, with the reason."""

SCANNED = ("planner", "runtime", "app", "benchmarks/gpu", "benchmarks/bench_runtime.py",
           "benchmarks/bench_nvme_step.py", "benchmarks/results_md.py", "tests", "tierwise")
"""Every third-party import under these must be in the image or travel as a wheel."""

class Stage(NamedTuple):
    """One stage of the call: what it shows, and its time on an H200 ([Note: sizing the call])."""

    what: str
    h200_s: int
    """Seconds expected on an H200 in a call on a fresh machine (the plan; the run log says what it took)."""
    min_s: int
    """The least time worth starting it with: with less of the call left, it is skipped and named."""
    cap_s: int
    """The most it may take: a stage that hangs leaves the rest of the call to the stages after it."""
    dry_cap_s: int | None = None
    """The cap in a dry run on the CPU, where it differs (compiling on a few shared cores)."""
    reserved: bool = False
    """A stage that measures our tiers: a stage before it in the call that is not reserved runs only in
    what is left less the planned seconds of the reserved stages after it, so that a baseline's
    build never takes our own measurement's time."""


STAGES = {
    "install": Stage("install the carried wheels (.whl/) and the project (editable, for `planner`); the carried "
                     "io_uring extension into runtime/", 30, 20, 150, reserved=True),
    "build": Stage("runtime._aio_ext and DeepSpeed's cpu_adam, async_io and pin_memory ops prebuilt into a "
                   "DeepSpeed wheel (returned in OUT; a carried one is only checked): the one place ops compile",
                   120, 45, 240, dry_cap_s=3600),
    "offload": Stage("the host-memory tier vs FSDP2 CPUOffloadPolicy and DeepSpeed ZeRO-3 CPU offload, and "
                     "all-on-GPU (ours, plain torch), the 1.1 B Llama in bf16 at seq 4096 and 2048", 120, 90, 240,
                     reserved=True),
    "nvme": Stage("the NVMe tier and the step's NVMe roofline, beside DeepSpeed ZeRO-Infinity (aio qd 128 x 1 "
                  "thread) where its ops are prebuilt, a 4-layer cut of the Llama, merged after each shape", 120, 60,
                  240, reserved=True),
    "pytest": Stage("pytest -m gpu (two ranks share the GPU over gloo where a test needs several)", 90, 85, 180),
    "parity": Stage("one-GPU parity on the fp32 MLP: each tier bitwise against plain torch running its arithmetic, "
                    "CPU vs CUDA AdamW within a derived bound", 30, 25, 60),
    "device": Stage("the fp32 MLP all on the GPU: ours vs plain torch", 35, 30, 90),
    "planner": Stage("planner probe -> fit -> run -> compare for the cpu, nvme and device plans", 150, 60, 240),
    "staged": Stage("the host tier's staged copies timed piece by piece, and a sampled trace of its threads", 30, 30, 90),
}
"""Stage -> what it shows and its time, in run order: the offload tiers first (`run.sh` with no stage
runs them all, each under what is left of the call's budget).

[Note: sizing the call]
One call on a fresh machine has CALL_BUDGET_S (420 s by default: the device's 15 minutes hold one
start, one 7-minute call and a second, shorter one). `h200_s` is the plan: each stage's seconds as
measured in the H200 calls (benchmarks/gpu/runs/; docs/notes/2026-11-28-h200-offload-tiers.md and
docs/notes/2026-11-28-h200-second-lease.md have them), planned a little above: install 27 s, build
124 s (ninja, the list normalised to 9.0; about 5 s once its outputs are carried), offload 116 s,
nvme 119 s, pytest 85 s, parity 28 s (a first CUDA start and two systems: its first call, planned
at 15 s, was stopped at 17 s), device 32 s, planner 138 s, staged 25 s.

The order keeps our tiers first: install, build, offload and nvme are 30 + 120 + 120 + 120 = 390 s
of a fresh call's 410 (less FINISH_MARGIN_S), and `build` is the only stage there that serves no
measurement of ours, so offload, nvme (and install) are `reserved`: the build runs in what is left
less their 240 s (a limit of about 144 s after a 26 s install), and a build that runs past it is
stopped with offload and nvme still ahead, their DeepSpeed systems then left out by name. The
checks come next (pytest, parity, device: 155 s; each starts only with at least its measured
seconds left, `min_s`, as none of them keeps a partial result), then the planner chains (150 s) and the staged
trace (30 s): a fresh call runs what fits of them; the second call (`bash benchmarks/gpu/run.sh install
pytest parity device planner staged`, as its log's last lines say, with a CALL_BUDGET_S the device time
left allows) runs the rest in 90 + 30 + 35 + 150 + 30 = 335 s after a warm install. With the built ops carried the build
takes seconds and pytest and parity fit in the first call.
"""

CALL_BUDGET_S = 420
"""The call's budget when the caller sets no CALL_BUDGET_S: 7 minutes ([Note: sizing the call])."""
FINISH_MARGIN_S = 10
"""Kept back from the budget for the last merge into OUT after the last stage."""


def emit(doc: dict, out: Path | None) -> int:
    """Print a stage's JSON document (and write it to `out`); the exit status says whether it is ok."""
    text = json.dumps(doc, indent=2)
    print(text)
    if out:
        out.write_text(text)
    return 0 if doc["ok"] else 1


def distribution(import_name: str) -> str:
    return IMPORT_NAMES.get(import_name, import_name.replace("_", "-")).lower()


def local_modules() -> set[str]:
    """Top-level names importable from the checkout itself (packages, and the script folders that
    put themselves on sys.path)."""
    names = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    for folder in ("benchmarks", "benchmarks/gpu", "tests"):
        names |= {p.stem for p in (ROOT / folder).glob("*.py")}
    return names | {"tierwise", "planner", "runtime", "app"}


def third_party_imports() -> dict[str, set[str]]:
    """Top-level third-party import name -> the files importing it, over SCANNED."""
    local = local_modules()
    found: dict[str, set[str]] = {}
    for entry in SCANNED:
        path = ROOT / entry
        files = [path] if path.suffix == ".py" else sorted(path.rglob("*.py")) if path.is_dir() else []
        for file in files:
            for node in ast.walk(ast.parse(file.read_text(), str(file))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in local:
                        found.setdefault(top, set()).add(str(file.relative_to(ROOT)))
    return found


def kit_files() -> tuple[list[Path], list[Path]]:
    return sorted(KIT.glob("*.py")), sorted(KIT.glob("*.sh"))


def check() -> dict:
    """The kit is complete: every import is covered, every script parses, no wheel is listed twice."""
    imports = third_party_imports()
    wheels = {n.lower() for n in (*WHEELS, *BUILT_WHEELS)}
    missing = {name: sorted(files) for name, files in sorted(imports.items())
               if distribution(name) not in IMAGE_PACKAGES | wheels and name not in OPTIONAL_IMPORTS}
    py_files, sh_files = kit_files()
    errors = []
    for file in [*py_files, ROOT / "benchmarks/bench_runtime.py", ROOT / "benchmarks/bench_nvme_step.py"]:
        try:  # what `python -m py_compile` checks, without writing a .pyc
            compile(file.read_text(), str(file), "exec")
        except SyntaxError as exc:
            errors.append(f"{file.relative_to(ROOT)}:{exc.lineno}: {exc.msg}")
    for file in sh_files:
        proc = subprocess.run(["bash", "-n", str(file)], capture_output=True, text=True)
        if proc.returncode:
            errors.append(f"{file.relative_to(ROOT)}: {proc.stderr.strip()}")
    overlap = sorted(set(WHEELS) & set(BUILT_WHEELS))
    ok = not missing and not errors and not overlap
    return {"ok": ok, "stages": list(STAGES), "imports": {k: distribution(k) for k in sorted(imports)},
            "from_image": sorted(k for k in imports if distribution(k) in IMAGE_PACKAGES),
            "from_wheels": sorted(k for k in imports if distribution(k) in wheels),
            "optional": sorted(k for k in imports if k in OPTIONAL_IMPORTS),
            "missing": missing, "parse_errors": errors, "listed_twice": overlap,
            "wheels": [f"{n}=={v}" for n, v in {**WHEELS, **BUILT_WHEELS}.items()], "debs": list(DEBS),
            "scripts": [str(p.relative_to(ROOT)) for p in (*py_files, *sh_files)]}


GPU_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
               "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
"""Environment markers of the GPU machine's Python, to read the wheels' Requires-Dist."""


def wheel_name(path: Path) -> tuple[str, str]:
    """(normalised distribution, version) from a wheel's file name."""
    name, version = path.name.split("-")[:2]
    return name.replace("_", "-").replace(".", "-").lower(), version


def requires(path: Path) -> list[str]:
    """The distributions a wheel needs on the GPU machine (Requires-Dist, markers evaluated there)."""
    import zipfile

    from packaging.requirements import Requirement

    with zipfile.ZipFile(path) as wheel:
        meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        lines = wheel.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.partition(":")[2].strip())
            if req.marker is None or req.marker.evaluate(GPU_MARKERS):
                out.append(req.name.replace("_", "-").replace(".", "-").lower())
    return out


def verify(folder: Path) -> dict:
    """The gathered folder holds exactly the listed wheels (one per name) and the .debs, and every
    wheel's own needs are in the image or the folder."""
    expected = {n.lower(): v for n, v in {**WHEELS, **BUILT_WHEELS}.items()}
    found: dict[str, list[str]] = {}
    for path in sorted(folder.glob("*.whl")):
        name, version = wheel_name(path)
        found.setdefault(name, []).append(version)
    problems = [f"{n}: no wheel of {v}" for n, v in expected.items() if found.get(n) != [v]]
    problems += [f"{n}: wheel(s) {vs} not in kit.py's lists" for n, vs in found.items() if n not in expected]
    have = IMAGE_PACKAGES | set(expected)
    for path in sorted(folder.glob("*.whl")):
        problems += [f"{path.name} needs {r}: neither in the image nor gathered" for r in requires(path)
                     if r not in have]
    debs = sorted(p.name for p in (folder / "deb").glob("*.deb"))
    problems += [f"{d}: no .deb" for d in DEBS if not any(p.startswith(f"{d}_") for p in debs)]
    problems += [f"{n}: no sdist src/{n}-{v}.tar.gz (the build stage builds the ops from it)"
                 for n, v in BUILT_WHEELS.items() if not (folder / "src" / f"{n}-{v}.tar.gz").is_file()]
    prebuilt = {p.name for p in folder.glob("*.whl") if "-cp" in p.name}
    problems += [f"{p}: built for another Python than the GPU's {GPU_PYTHON_TAG}" for p in sorted(prebuilt)
                 if f"-{GPU_PYTHON_TAG}-" not in p]
    ops = sorted(p.name for p in (folder / "ops").glob("*.so"))
    problems += [f"ops/{p}: built for another Python than the GPU's {GPU_PYTHON_TAG}" for p in ops
                 if f".cpython-{GPU_PYTHON_TAG.removeprefix('cp')}-" not in p]
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return {"ok": not problems, "folder": str(folder), "wheels": sum(len(v) for v in found.values()),
            "debs": debs, "binary_wheels": sorted(prebuilt), "ops": ops, "bytes": size, "problems": problems}


def main(argv: list[str]) -> int:
    verb = argv[0] if argv else "check"
    if verb == "wheels":
        print("\n".join(f"{n}=={v}" for n, v in WHEELS.items()))
        return 0
    if verb == "built":
        print("\n".join(f"{n}=={v}" for n, v in BUILT_WHEELS.items()))
        return 0
    if verb == "debs":
        print("\n".join(DEBS))
        return 0
    if verb == "stages":
        print("\n".join(f"{n}\t{s.what}" for n, s in STAGES.items()))
        return 0
    if verb == "verify":
        doc = verify(Path(argv[1]) if len(argv) > 1 else ROOT / ".whl")
        print(json.dumps(doc, indent=2))
        return 0 if doc["ok"] else 1
    if verb == "check":
        doc = check()
        print(json.dumps(doc, indent=2))
        return 0 if doc["ok"] else 1
    print(f"unknown verb {verb!r}: use check, verify [DIR], wheels, built, debs or stages", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
