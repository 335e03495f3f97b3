"""Error paths of the NVMe tier: every failure names the path, offset, size and errno."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from runtime.nvme import (
    AlignedBuffer,
    DirectIOFallbackWarning,
    EngineConfig,
    IOEngine,
    SwapDirectory,
    SwapPathError,
    open_io_file,
)
from runtime.nvme import files as nvme_files
from runtime.nvme.directory import free_bytes

BACKENDS = ["io_uring", "threads", "python"]
REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, *, prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [*(prefix or []), sys.executable, "-c", textwrap.dedent(code)]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_past_end_of_file_names_path_offset_size_and_errno(tmp_path, backend):
    engine = IOEngine(EngineConfig(block_size_bytes=8192, backend=backend))
    path = tmp_path / "short.swap"
    with open_io_file(path, create=True) as file:
        os.posix_fallocate(file.direct_fd, 0, 16384)
        for buffer in (AlignedBuffer(32768).view, bytearray(20000)):  # direct and buffered paths
            with pytest.raises(OSError) as caught:
                engine.read(file, offset=4096, buffer=buffer)
            error = caught.value
            assert error.errno == errno.ENODATA
            assert error.filename == str(path)
            # The failure with the lowest offset is reported: the block that reached the end.
            assert (error.offset, error.nbytes) == (16384, 4096)
            assert f"bytes at offset 16384): '{path}'" in str(error)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_descriptor_is_reported_as_errno(tmp_path, backend):
    engine = IOEngine(EngineConfig(backend=backend))
    path = tmp_path / "closed.swap"
    file = open_io_file(path, create=True)
    file.close()
    with pytest.raises(OSError) as caught:
        engine.write(file, offset=0, buffer=b"abc")
    assert caught.value.errno == errno.EBADF
    assert caught.value.filename == str(path)


@pytest.mark.parametrize("backend", BACKENDS)
def test_file_size_limit_raises_efbig_with_the_failing_block(tmp_path, backend):
    # RLIMIT_FSIZE of 1 MiB in a child process: a 2 MiB write fails at offset 1 MiB with EFBIG.
    # (Python ignores SIGXFSZ, so the write returns the error instead of killing the process.)
    result = run_python(
        f"""
        import errno, resource
        from runtime.nvme import AlignedBuffer, EngineConfig, IOEngine, open_io_file
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        engine = IOEngine(EngineConfig(block_size_bytes=256 << 10, backend={backend!r}))
        buffer = AlignedBuffer(2 << 20)
        with open_io_file({str(tmp_path / "big.swap")!r}, create=True) as file:
            try:
                engine.write(file, offset=0, buffer=buffer.view)
            except OSError as error:
                print(error.errno == errno.EFBIG, error.offset, error.nbytes, error.filename)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", str(1 << 20), str(256 << 10), str(tmp_path / "big.swap")]


def test_missing_directory_is_a_one_line_error(tmp_path):
    with pytest.raises(SwapPathError, match=r"^nvme_path .*/nope does not exist; create it or choose another"):
        SwapDirectory(tmp_path / "nope")


def test_file_instead_of_directory_is_a_one_line_error(tmp_path):
    (tmp_path / "plain").write_text("x")
    with pytest.raises(SwapPathError, match=r"is not a directory"):
        SwapDirectory(tmp_path / "plain")


def test_path_traversal_in_tier_names_is_refused(tmp_path):
    with SwapDirectory(tmp_path) as directory:
        for name in ("../escape", "a/b", "", "..", "owner.json"):
            with pytest.raises(SwapPathError, match="must be letters, digits"):
                directory.file_path(name)
        assert list(tmp_path.iterdir()) == [directory.path]


def test_unwritable_directory_is_a_one_line_error(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    expected = f"nvme_path {locked} is not writable by this user; fix its permissions or choose another"
    if os.geteuid() != 0:
        locked.chmod(0o555)
        with pytest.raises(SwapPathError) as caught:
            SwapDirectory(locked)
        assert str(caught.value) == expected
        return
    # Root ignores permission bits, so make the directory a read-only mount in a private namespace.
    result = run_python(
        f"""
        import subprocess
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "none", {str(locked)!r}], check=True)
        from runtime.nvme import SwapDirectory, SwapPathError
        try:
            SwapDirectory({str(locked)!r})
        except SwapPathError as error:
            print(error)
        """,
        prefix=["unshare", "--user", "--map-root-user", "--mount"],
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected


def test_capacity_preflight_fails_before_creating_anything(tmp_path):
    needed = free_bytes(tmp_path) + (1 << 40)
    with pytest.raises(SwapPathError, match=r"GiB free but the swap files need .* TiB; free space there or choose another nvme_path$"):
        SwapDirectory(tmp_path, needed_bytes=needed)
    assert list(tmp_path.iterdir()) == []


def test_direct_io_refusal_falls_back_with_one_warning(tmp_path, monkeypatch):
    # Simulated refusal (EINVAL on O_DIRECT opens); the real one on ramfs is the next test.
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(nvme_files.os, "open", refusing_open)
    monkeypatch.setattr(nvme_files, "_warned_devices", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        files = [open_io_file(tmp_path / f"f{i}.swap", create=True) for i in range(3)]
    assert [w.category for w in caught] == [DirectIOFallbackWarning]
    assert "refuses O_DIRECT" in str(caught[0].message)
    for backend in BACKENDS:
        engine = IOEngine(EngineConfig(backend=backend))
        payload = AlignedBuffer(1 << 20)
        payload.view[:] = os.urandom(1 << 20)
        engine.write(files[0], offset=4096, buffer=payload.view)
        back = AlignedBuffer(1 << 20)
        engine.read(files[0], offset=4096, buffer=back.view)
        assert bytes(back.view) == bytes(payload.view)
    assert all(not f.direct and f.direct_fd == f.buffered_fd for f in files)
    for f in files:
        f.close()


@pytest.mark.slow
def test_ramfs_refuses_o_direct_and_small_tmpfs_runs_out_of_space(tmp_path):
    # Real filesystems, mounted in a private user+mount namespace (no root needed): ramfs refuses
    # O_DIRECT at open; a 1 MiB tmpfs fails the preflight and then a write with ENOSPC.
    assert shutil.which("unshare"), "util-linux `unshare` is needed for this test"
    ram, small = tmp_path / "ram", tmp_path / "small"
    ram.mkdir(), small.mkdir()
    code = f"""
import errno, os, subprocess, warnings
subprocess.run(["mount", "-t", "ramfs", "none", {str(ram)!r}], check=True)
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "none", {str(small)!r}], check=True)
from runtime.nvme import AlignedBuffer, EngineConfig, IOEngine, SwapDirectory, SwapPathError, SwapStore
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with SwapDirectory({str(ram)!r}) as directory:
        stores = [SwapStore(directory, name, capacity_bytes=1 << 20) for name in ("params", "optimizer_states")]
        buffer = AlignedBuffer(1 << 20)
        buffer.view[:] = os.urandom(1 << 20)
        extent = stores[1].allocate(1 << 20)
        stores[1].write_async(extent, buffer.view).wait()
        back = bytearray(1 << 20)
        stores[1].read_async(extent, back).wait()
        print("ramfs", [s.direct for s in stores], bytes(back) == bytes(buffer.view), len(caught))
try:
    SwapDirectory({str(small)!r}, needed_bytes=2 << 20)
except SwapPathError as error:
    print("preflight", str(error).endswith("has 1.00 MiB free but the swap files need 2.00 MiB; free space there or choose another nvme_path"))
path = {str(small / "fill.swap")!r}
from runtime.nvme import open_io_file
with open_io_file(path, create=True) as file:
    for backend in ("io_uring", "threads", "python"):
        try:
            IOEngine(EngineConfig(backend=backend)).write(file, offset=0, buffer=AlignedBuffer(2 << 20).view)
        except OSError as error:
            print("enospc", backend, error.errno == errno.ENOSPC, error.filename == path, error.offset > 0)
"""
    result = run_python(code, prefix=["unshare", "--user", "--map-root-user", "--mount"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "ramfs [False, False] True 1",
        "preflight True",
        "enospc io_uring True True True",
        "enospc threads True True True",
        "enospc python True True True",
    ]
