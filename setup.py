"""Package layout and the optional C++ async I/O extension (everything else is in pyproject.toml).

- data/ sits at the top level (docs/architecture.md) and ships inside the package as `planner._data`.
- csrc/*.cpp build `runtime._aio_ext` with pybind11 (no torch headers). The extension is optional:
  without a compiler the runtime falls back to its pure-Python engine, which behaves the same.
"""

from pathlib import Path

from setuptools import find_packages, setup

packages = find_packages(include=["planner", "planner.*", "tierwise", "tierwise.*", "runtime", "runtime.*", "app", "app.*"])
data_packages = ["planner._data"] + [f"planner._data.{p.name}" for p in sorted(Path("data").iterdir()) if p.is_dir()]

ext_modules = []
sources = sorted(str(p) for p in Path("csrc").glob("*.cpp"))
if sources:
    from pybind11.setup_helpers import ParallelCompile, Pybind11Extension

    # The sources compile independently, so they compile side by side, one compiler per core
    # (NPY_NUM_BUILD_JOBS caps it), rather than one after another.
    ParallelCompile("NPY_NUM_BUILD_JOBS").install()
    ext_modules.append(
        Pybind11Extension(
            "runtime._aio_ext",
            sources,
            cxx_std=17,
            extra_compile_args=["-O3"],
            optional=True,
        )
    )

setup(
    packages=packages + data_packages,
    package_dir={"planner._data": "data"},
    package_data={name: ["*.json", "*.yaml", "*.csv", "*.md"] for name in data_packages},
    ext_modules=ext_modules,
)
