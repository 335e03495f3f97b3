"""The GPU kit's build stage: the project's io_uring engine (`runtime._aio_ext`) and DeepSpeed's ops
(cpu_adam, async_io and the pin_memory op async_io loads) built once, each checked to load with no
JIT build, and returned in OUT for `gather_wheels.sh --built` to carry from then on.

    python benchmarks/gpu/build_ops.py --wheels .whl --work WORK --out OUT [--site DIR] [--json build.json]

[Note: what DeepSpeed loads]
DeepSpeed 0.19.8's `OpBuilder.load()` imports a prebuilt op module (`deepspeed.ops.adam.cpu_adam_op`,
`deepspeed.ops.aio.async_io_op`, `deepspeed.ops.pin_memory.pin_memory_op`) when the installed wheel's
`deepspeed/git_version_info_installed.py` marks the op built (`installed_ops`) for this accelerator
and the torch and CUDA versions it was built with match; otherwise it JIT-builds the op with ninja
into TORCH_EXTENSIONS_DIR, a minute or more per op on a fresh machine. Its `setup.py` prebuilds the
ops named by DS_BUILD_<OP>=1 into the wheel (`pip wheel` of the sdist), but an op whose
`is_compatible()` fails (async_io without libaio's headers) is left out with a warning and the build
still succeeds. So this stage reads `installed_ops` of what it built and loads every op in a fresh
process with `OpBuilder.jit_load` disabled: an op missing or needing a JIT build fails the stage by
name. The compiled ops carry debug information (16 MB for cpu_adam alone, more than the device
returns per file): the wheel is unpacked, its shared objects stripped of it, and packed again
(`wheel pack` rewrites the RECORD hashes).

A DeepSpeed already prebuilt (the carried wheel, installed by the install stage) or a wheel built
earlier on this machine (WORK/built) is only checked. `--site DIR` installs the built wheel there
(`pip install --target`; the stages put DIR first on PYTHONPATH) instead of into the environment:
the dry run never changes the environment it runs in.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kit import ROOT, emit

DEEPSPEED_OPS = {"cpu_adam": "CPUAdamBuilder", "async_io": "AsyncIOBuilder", "pin_memory": "PinMemoryBuilder"}
"""The ops the kit's DeepSpeed systems load -> their builder class in deepspeed.ops.op_builder."""
RETURNED_FILE_BYTES = 16 * 2**20
"""The largest file the device returns from OUT."""
BUILD_VARS = {"DS_BUILD_OPS": "0", "DS_BUILD_CPU_ADAM": "1", "DS_BUILD_AIO": "1", "DS_BUILD_PIN_MEMORY": "1",
              "DS_ENABLE_NINJA": "1"}
"""setup.py's switches: no op but these three, each compiled by ninja.

[Note: a short build]
setup.py compiles each prebuilt op as one extension, the ops one after another. Without
DS_ENABLE_NINJA torch's BuildExtension compiles an extension's files one at a time; with it, ninja
compiles them MAX_JOBS at a time. The ops' files: cpu_adam 2 (`-O3 -g`, AVX-512 templates: the
heavy ones), async_io 12 (`-O0`), pin_memory 3 (`-O3 -g`); 13 of the 17 (cpu_adam 2, async_io 9,
pin_memory 2) include torch's extension headers, which is most of such a file's time, and the other
4 compile in seconds. On 16 cores with ninja the build is about the slowest file of each op, one op
after the other; serially it is the sum of the 13. The wheel build's output is streamed into the log with
the seconds since its start (each file as ninja finishes it, each link; all of it in
WORK/deepspeed-build.log), and WORK/build.json is rewritten as each op starts, so a build cut at its
limit still says how far it came and what each op and file took ([Note: sizing the call] in kit.py)."""
GPU_ARCH_LIST = "9.0"
"""The architecture list for DeepSpeed's build where the environment sets none: Hopper (H100, H200).

[Note: the build's architecture list]
The GPU image sets TORCH_CUDA_ARCH_LIST=9.0a (Hopper with its architecture-specific instructions).
DeepSpeed 0.19.8's `CUDAOpBuilder.compute_capability_args` parses each entry as MAJOR.MINOR[+PTX]
with `int(minor_part.split('+')[0])`, which raises on `0a`; setup.py calls it for every CUDA op it
prebuilds (async_io is one), so the whole wheel build stops before compiling anything
(docs/notes/2026-11-28-h200-offload-tiers.md). The build therefore always passes DeepSpeed the list with each entry's
letter suffix dropped (`9.0a` -> `9.0`, `10.0f` -> `10.0`, `+PTX` kept), whatever the environment
holds. Dropping it changes no code: the list only becomes nvcc's `-gencode` flags, and none of the
three ops compiles a file with nvcc. async_io is the one CUDA extension (CUDAOpBuilder) and its
sources are all `.cpp`, compiled by the host compiler; cpu_adam (op_builder/cpu/cpu_adam.py, which
the CUDA accelerator maps it to) and pin_memory are plain C++ extensions that never read the list;
`deepspeed_cuda_sources` checks that the builders still say so. (Were a kernel ever compiled for
`sm_90` instead of `sm_90a`, it would still run on an H100 or H200: the suffix only adds Hopper's
architecture-specific instructions.)"""

_PROBE = r"""
import json, sys
from deepspeed.git_version_info import installed_ops, accelerator_name
from deepspeed.accelerator import get_accelerator
from deepspeed.ops import op_builder
from deepspeed.ops.op_builder.builder import OpBuilder

def refuse(self, verbose=True):
    raise RuntimeError(f"DeepSpeed would JIT-build {self.name}: it is not prebuilt in {__import__('deepspeed').__file__}")

OpBuilder.jit_load = refuse
doc = {"deepspeed": __import__("deepspeed").__file__, "accelerator": get_accelerator()._name,
       "built_for": accelerator_name, "ops": {}}
for name, cls in json.loads(sys.argv[1]).items():
    entry = {"in_wheel": bool(installed_ops.get(name))}
    try:
        module = getattr(op_builder, cls)().load()
        entry |= {"ok": True, "module": module.__name__, "file": getattr(module, "__file__", None)}
    except Exception as exc:  # each op's failure is reported by name
        entry |= {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-600:]}
    doc["ops"][name] = entry
print(json.dumps(doc))
"""


def run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`cmd` with its output captured (the log gets its tail where it matters)."""
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)


def stage_env(site: Path | None) -> dict[str, str]:
    """This process's environment with `site` first on PYTHONPATH (where a built DeepSpeed went)."""
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    return env


def probe_ops(env: dict[str, str]) -> dict:
    """In a fresh process: which DeepSpeed is imported and, per op, whether it loads with no JIT build."""
    proc = run([sys.executable, "-c", _PROBE, json.dumps(DEEPSPEED_OPS)], env)
    if proc.returncode != 0:
        return {"error": f"DeepSpeed does not import: {(proc.stderr or proc.stdout).strip()[-1500:]}", "ops": {}}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def missing_ops(probe: dict) -> list[str]:
    """The ops that are not prebuilt and loadable, each with why (empty: every op is ready)."""
    if "error" in probe:
        return [f"deepspeed: {probe['error']}"]
    out = []
    for name in DEEPSPEED_OPS:
        entry = probe["ops"].get(name, {})
        if not entry.get("in_wheel"):
            out.append(f"{name}: not prebuilt in {probe['deepspeed']} (installed_ops), so DeepSpeed would JIT-build it")
        elif not entry.get("ok"):
            out.append(f"{name}: prebuilt but does not load: {entry.get('error')}")
    if not out and probe.get("built_for") != probe.get("accelerator"):
        out.append(f"ops built for accelerator {probe.get('built_for')!r}, running on {probe.get('accelerator')!r}")
    return out


def aio_extension(out: Path) -> dict:
    """`runtime._aio_ext`: imported as carried, else built in place (`setup.py build_ext`, which skips a
    failed optional extension silently, so the import decides); the built file is copied to `out`."""
    check = [sys.executable, "-c", "import json, runtime._aio_ext as e; print(json.dumps([e.__file__, *e.io_uring_available()]))"]
    proc = run(check)
    how = "carried"
    start = time.perf_counter()
    if proc.returncode != 0:
        how = "built"
        build = run([sys.executable, "setup.py", "-q", "build_ext", "--inplace", "-j", str(os.cpu_count() or 1)])
        proc = run(check)
        if proc.returncode != 0:
            return {"ok": False, "error": "runtime._aio_ext failed to build or import: "
                    + (build.stderr or build.stdout or proc.stderr).strip()[-1500:]}
    path, io_uring, why = json.loads(proc.stdout.strip().splitlines()[-1])
    if how == "built":
        shutil.copy2(path, out / Path(path).name)
    inside = Path(path).resolve().is_relative_to(ROOT)  # the results name the checkout's files relative to it
    return {"ok": True, "how": how, "file": str(Path(path).resolve().relative_to(ROOT)) if inside else path,
            "io_uring": bool(io_uring), "io_uring_detail": why,
            "seconds": round(time.perf_counter() - start, 1)}


def libcuda_dirs() -> list[str]:
    """Folders with a `libcuda.so` for the async_io op's `-lcuda` at link time: the CUDA toolkit's
    stubs, and the driver's folders on LD_LIBRARY_PATH (the linker does not search that variable)."""
    nvcc = shutil.which("nvcc")
    home = Path(nvcc).resolve().parents[1] if nvcc else None
    candidates = [home / "lib64" / "stubs", home / "targets" / "x86_64-linux" / "lib" / "stubs"] if home else []
    candidates += [Path(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    candidates += [Path("/usr/local/nvidia/lib64"), Path("/usr/lib/x86_64-linux-gnu")]
    return list(dict.fromkeys(str(c) for c in candidates if (c / "libcuda.so").exists()))


def deepspeed_arch_list(value: str | None) -> str:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed 0.19.8's builder parses it: each entry's architecture-specific
    letter suffix dropped (`9.0a` -> `9.0`; `+PTX` kept), entries separated by `;`, GPU_ARCH_LIST when
    unset ([Note: the build's architecture list])."""
    entries = (value or "").replace(" ", ";").split(";")
    out = []
    for entry in filter(None, (e.strip() for e in entries)):
        arch, plus, ptx = entry.partition("+")
        major, _, minor = arch.partition(".")
        if not major.isdigit() or not minor.rstrip("abcdefghijklmnopqrstuvwxyz").isdigit():
            raise ValueError(f"TORCH_CUDA_ARCH_LIST entry {entry!r} is not MAJOR.MINOR[letter][+PTX]: set e.g. "
                             f"TORCH_CUDA_ARCH_LIST={GPU_ARCH_LIST}")
        out.append(f"{major}.{minor.rstrip('abcdefghijklmnopqrstuvwxyz')}{plus}{ptx}")
    return ";".join(dict.fromkeys(out)) or GPU_ARCH_LIST


def deepspeed_cuda_sources() -> dict[str, list[str]]:
    """Op -> the sources nvcc would compile (`.cu`), from the installed DeepSpeed's builders: empty for
    every op is what makes the architecture list irrelevant ([Note: the build's architecture list])."""
    from deepspeed.ops.op_builder.async_io import AsyncIOBuilder  # the CUDA accelerator's, on any machine
    from deepspeed.ops.op_builder.cpu.cpu_adam import (
        CPUAdamBuilder,  # what the CUDA accelerator maps cpu_adam to
    )
    from deepspeed.ops.op_builder.pin_memory import PinMemoryBuilder

    builders = {"cpu_adam": CPUAdamBuilder(), "async_io": AsyncIOBuilder(), "pin_memory": PinMemoryBuilder()}
    return {name: [s for s in b.sources() if s.endswith((".cu", ".cuh"))] for name, b in builders.items()}


def build_env(environ: dict[str, str], cpus: int) -> dict[str, str]:
    """The environment of DeepSpeed's wheel build: BUILD_VARS, ninja on every core, and where nvcc
    exists the architecture list DeepSpeed can parse (the environment's own, normalised)."""
    env = {**environ, **BUILD_VARS, "MAX_JOBS": str(cpus)}
    if shutil.which("nvcc", path=environ.get("PATH")) or "TORCH_CUDA_ARCH_LIST" in environ:
        env["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(environ.get("TORCH_CUDA_ARCH_LIST"))
    return env


MARKERS = (("building '", "op"), ("deepspeed build time", "setup"), ("Created wheel", "wheel"))
"""Lines of DeepSpeed's verbose build that mark its progress in the stage's JSON (an op starting,
setup.py done, the wheel written)."""


def brief(line: str) -> str | None:
    """What the log shows of a line of DeepSpeed's verbose build: the markers, each file ninja finished
    (`[3/12] deepspeed_py_aio.cpp`: ninja prints a command as it ends), each link, errors; None for the
    rest (the whole output goes to a file in WORK)."""
    text = line.strip()
    compiled = re.match(r"^(\[\d+/\d+\]) .* -c (\S+) -o ", text)
    if compiled:
        return f"{compiled[1]} compiled {Path(compiled[2]).name}"
    linked = re.match(r"^\S*(?:c\+\+|g\+\+)\S* .*-shared .*-o (\S+)", text)
    if linked:
        return f"linked {Path(linked[1]).name}"
    if any(m in text for m, _ in MARKERS) or re.search(r"\berror\b|Error:|Traceback", text):
        return text[:300]
    return None


def streamed(cmd: list[str], env: dict[str, str], progress, full_log: Path | None = None) -> tuple[int, str]:  # noqa: ANN001
    """`cmd`, its `brief` lines printed with the seconds since its start (the log shows how far a build
    came and what each file took when it is cut), `progress` told (seconds, line) of each MARKERS
    line, every line kept in `full_log`; (exit code, the output's tail)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    tail: list[str] = []
    with open(full_log or os.devnull, "w") as keep:
        for line in proc.stdout:
            seconds = time.perf_counter() - start
            keep.write(line)
            shown = brief(line)
            if shown is not None:
                print(f"build +{seconds:6.1f} s: {shown}", flush=True)
            tail = [*tail[-60:], line.rstrip()]
            if any(m in line for m, _ in MARKERS):
                progress(round(seconds, 1), line.strip()[:200])
    return proc.wait(), "\n".join(tail)


def op_seconds(timeline: list[list]) -> dict[str, float]:
    """Op -> seconds, from the build's timeline: each op's start to the next marker."""
    out = {}
    for (t, line), (t_next, _) in zip(timeline[:-1], timeline[1:], strict=True):
        if line.startswith("building '"):
            out[line.split("'")[1].rsplit(".", 1)[-1].removesuffix("_op")] = round(t_next - t, 1)
    return out


def build_wheel(sdist: Path, work: Path, progress=lambda seconds, line: None) -> Path:  # noqa: ANN001
    """DeepSpeed's wheel with the ops of BUILD_VARS prebuilt and their debug information stripped."""
    raw, unpacked, packed = work / "raw", work / "unpacked", work / "built"
    for folder in (raw, unpacked):
        shutil.rmtree(folder, ignore_errors=True)
    env = build_env(dict(os.environ), os.cpu_count() or 1)
    link = os.pathsep.join(libcuda_dirs() + [p for p in env.get("LIBRARY_PATH", "").split(os.pathsep) if p])
    if link:
        env["LIBRARY_PATH"] = link
    print(f"build: DeepSpeed's ops with TORCH_CUDA_ARCH_LIST={env.get('TORCH_CUDA_ARCH_LIST', '(unset)')}, "
          f"ninja, MAX_JOBS={env['MAX_JOBS']}", flush=True)
    code, tail = streamed([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "--no-index",
                           "--no-cache-dir", "-w", str(raw), str(sdist)], env, progress, work / "deepspeed-build.log")
    wheels = sorted(raw.glob("deepspeed-*.whl"))
    if code != 0 or not wheels:
        raise RuntimeError(f"pip wheel {sdist.name} failed: {tail[-2000:]}")
    proc = run([sys.executable, "-m", "wheel", "unpack", "-d", str(unpacked), str(wheels[0])])
    if proc.returncode != 0:
        raise RuntimeError(f"wheel unpack failed: {proc.stderr.strip()[-800:]}")
    tree = next(unpacked.iterdir())
    for so in tree.rglob("*.so"):
        stripped = run(["strip", "--strip-debug", str(so)])
        if stripped.returncode != 0:
            raise RuntimeError(f"strip {so.name} failed (the wheel would be too large to return): {stripped.stderr[-400:]}")
    packed.mkdir(parents=True, exist_ok=True)
    for old in packed.glob("deepspeed-*.whl"):
        old.unlink()
    proc = run([sys.executable, "-m", "wheel", "pack", "-d", str(packed), str(tree)])
    built = sorted(packed.glob("deepspeed-*.whl"))
    if proc.returncode != 0 or not built:
        raise RuntimeError(f"wheel pack failed: {proc.stderr.strip()[-800:]}")
    return built[0]


def install(wheel: Path, site: Path | None) -> None:
    target = ["--target", str(site), "--upgrade"] if site is not None else ["--force-reinstall"]
    proc = run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-cache-dir",
                "--no-compile", *target, str(wheel)])
    if proc.returncode != 0:
        raise RuntimeError(f"pip install {wheel.name} failed: {(proc.stderr or proc.stdout).strip()[-800:]}")


def deepspeed_ops(wheels: Path, work: Path, out: Path, site: Path | None, report=lambda doc: None) -> dict:  # noqa: ANN001
    """DeepSpeed's ops ready with no JIT build: as carried, from a wheel built earlier on this machine,
    or built now from the carried sdist; the doc names every op that is not ready. `report` is given
    the doc as the build goes (the stage's JSON so far)."""
    env = stage_env(site)
    start = time.perf_counter()
    probe = probe_ops(env)
    doc: dict = {"how": "carried"}

    def progress(seconds: float, line: str) -> None:
        doc.setdefault("timeline", []).append([seconds, line])
        doc["op_seconds"] = op_seconds(doc["timeline"])
        report(doc)

    built = sorted((work / "built").glob("deepspeed-*.whl"))
    try:
        if missing_ops(probe) and built:
            doc["how"] = "built earlier on this machine"
            install(built[0], site)
            probe = probe_ops(env)
        if missing_ops(probe):
            sdists = sorted((wheels / "src").glob("deepspeed-*.tar.gz"))
            if not sdists:
                raise RuntimeError(f"no DeepSpeed sdist in {wheels / 'src'} to build the ops from: run gather_wheels.sh")
            doc |= {"how": "built", "arch_list": build_env(dict(os.environ), 1).get("TORCH_CUDA_ARCH_LIST")}
            report(doc)
            wheel = build_wheel(sdists[0], work, progress)
            doc["wheel_build_s"] = round(time.perf_counter() - start, 1)
            install(wheel, site)
            shutil.copy2(wheel, out / wheel.name)
            doc |= {"wheel": wheel.name, "wheel_bytes": wheel.stat().st_size}
            if wheel.stat().st_size > RETURNED_FILE_BYTES:
                doc["error"] = f"{wheel.name} is {wheel.stat().st_size / 2**20:.1f} MiB, over what a call returns per file"
            probe = probe_ops(env)
    except RuntimeError as exc:
        doc["error"] = str(exc)
    problems = missing_ops(probe)
    return doc | {"ok": not problems and "error" not in doc, "problems": problems, "probe": probe,
                  "seconds": round(time.perf_counter() - start, 1)}


def cpu_comm_op(site: Path | None) -> dict:
    """On DeepSpeed's CPU accelerator (the dry run): its shm_comm op, which DeepSpeed JIT-builds when
    its communication starts, built here into TORCH_EXTENSIONS_DIR, so that the offload and nvme
    stages load it from there instead of compiling it within their caps (minutes on 2 cores)."""
    start = time.perf_counter()
    proc = run([sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; print(build_shm_op())"],
               stage_env(site))
    doc = {"ok": proc.returncode == 0, "seconds": round(time.perf_counter() - start, 1)}
    return doc if doc["ok"] else doc | {"error": (proc.stderr or proc.stdout).strip()[-800:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="the carried folder (DeepSpeed's sdist in src/)")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="where what was built is returned")
    ap.add_argument("--site", type=Path, help="install a built DeepSpeed here (pip --target) instead of the environment")
    ap.add_argument("--json", type=Path, help="write the stage's JSON here too")
    args = ap.parse_args()
    for folder in (args.work, args.out):
        folder.mkdir(parents=True, exist_ok=True)
    doc: dict = {"aio_ext": aio_extension(args.out)}

    def so_far(deepspeed: dict) -> None:  # a cut keeps this ([Note: results survive a cut] in call.py)
        if args.json:
            args.json.write_text(json.dumps({**doc, "deepspeed": deepspeed, "ok": False, "partial": True}, indent=2))

    doc["deepspeed"] = deepspeed_ops(args.wheels, args.work, args.out, args.site, so_far)
    if doc["deepspeed"].get("probe", {}).get("accelerator") == "cpu":
        doc["deepspeed"]["cpu_comm"] = cpu_comm_op(args.site)
    failed = ([] if doc["aio_ext"]["ok"] else [f"runtime._aio_ext: {doc['aio_ext']['error']}"])
    failed += [f"deepspeed {p}" for p in doc["deepspeed"]["problems"]]
    if "error" in doc["deepspeed"]:
        failed.append(f"deepspeed: {doc['deepspeed']['error']}")
    doc |= {"ok": not failed, "failed": failed}
    code = emit(doc, args.json)
    for line in failed:
        print(f"build: FAILED: {line}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
