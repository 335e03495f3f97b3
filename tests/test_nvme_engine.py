"""The async I/O engine: bitwise round trips on every backend, checked byte by byte against the
pure-Python reference engine and against plain os.pread."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.nvme import AlignedBuffer, EngineConfig, IOEngine, io_uring_available, open_io_file

BACKENDS = ["io_uring", "threads", "python"]
FILE_BYTES = 4 << 20
SMALL_BLOCK = 16 << 10  # small blocks so that modest requests split into many


def test_extension_and_io_uring_are_built_here():
    # The suite's install builds the extension (a compiler is required) on a kernel with io_uring; the other
    # tests rely on both backends.
    assert io_uring_available()
    assert IOEngine(EngineConfig()).backend == "io_uring"  # what `auto` picks when it can


@pytest.fixture(scope="module")
def io_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "data.swap"
    with open_io_file(path, create=True) as file:
        os.posix_fallocate(file.direct_fd, 0, FILE_BYTES)
        assert file.direct
        yield file


@pytest.fixture(scope="module")
def engines():
    return {b: IOEngine(EngineConfig(block_size_bytes=SMALL_BLOCK, queue_depth=8, num_threads=3, backend=b)) for b in BACKENDS}


def test_backends_report_their_names(engines):
    assert {name: engine.backend for name, engine in engines.items()} == {b: b for b in BACKENDS}


def _view(nbytes: int, misalign: int) -> tuple[AlignedBuffer, memoryview]:
    """A writable buffer of `nbytes` starting `misalign` bytes past a page boundary."""
    backing = AlignedBuffer(nbytes + misalign + 1)
    return backing, backing.view[misalign : misalign + nbytes]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    writer=st.sampled_from(BACKENDS),
    reader=st.sampled_from(BACKENDS),
    offset=st.one_of(st.integers(0, 1 << 20), st.integers(0, 256).map(lambda k: k * 4096)),
    nbytes=st.one_of(st.integers(0, 300_000), st.integers(0, 64).map(lambda k: k * 4096)),
    misalign=st.sampled_from([0, 0, 1, 512, 4095]),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_is_bitwise_for_any_size_offset_and_alignment(
    engines, io_file, writer, reader, offset, nbytes, misalign, seed
):
    payload = random.Random(seed).randbytes(nbytes)
    source_backing, source = _view(nbytes, misalign)
    source[:] = payload
    engines[writer].write(io_file, offset=offset, buffer=source)
    assert os.pread(io_file.buffered_fd, nbytes, offset) == payload  # what the kernel holds

    target_backing, target = _view(nbytes, (misalign * 7) % 4096)
    engines[reader].read(io_file, offset=offset, buffer=target)
    assert bytes(target) == payload
    source.release(), target.release()
    source_backing.close(), target_backing.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_concurrent_reads_and_writes(engines, io_file, backend):
    # 96 disjoint ranges, many sharing 4 KiB blocks with their neighbours, all in flight at once.
    rng = random.Random(7)
    engine = engines[backend]
    cuts = sorted(rng.sample(range(1, FILE_BYTES // 2), 95))
    bounds = list(zip([0, *cuts], [*cuts, FILE_BYTES // 2], strict=True))
    payloads = [rng.randbytes(end - start) for start, end in bounds]
    writes = [engine.write_async(io_file, offset=s, buffer=p) for (s, _), p in zip(bounds, payloads, strict=True)]
    for handle in writes:
        handle.wait()
    targets = [bytearray(end - start) for start, end in bounds]
    reads = [engine.read_async(io_file, offset=s, buffer=t) for (s, _), t in zip(bounds, targets, strict=True)]
    for handle in reversed(reads):  # waiting out of order is fine
        handle.wait()
    assert [bytes(t) for t in targets] == payloads
    assert os.pread(io_file.buffered_fd, FILE_BYTES // 2, 0) == b"".join(payloads)


def test_backends_agree_on_a_large_aligned_transfer(engines, io_file):
    # Direct I/O end to end (aligned memory, offset and size), written by each backend in turn and
    # read back by every backend: all bytes identical to the reference engine's.
    nbytes = 3 << 20
    for writer in BACKENDS:
        source = AlignedBuffer(nbytes)
        source.view[:] = random.Random(writer).randbytes(nbytes)
        engines[writer].write(io_file, offset=1 << 20, buffer=source.view)
        results = {}
        for reader in BACKENDS:
            target = AlignedBuffer(nbytes)
            engines[reader].read(io_file, offset=1 << 20, buffer=target.view)
            results[reader] = bytes(target.view)
            target.close()
        assert results["io_uring"] == results["threads"] == results["python"] == bytes(source.view)
        source.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_handle_done_and_repeated_wait(engines, io_file, backend):
    buffer = bytearray(b"x" * 10_000)
    handle = engines[backend].write_async(io_file, offset=5, buffer=buffer)
    handle.wait()
    assert handle.done()
    handle.wait()  # a second wait is a no-op
    empty = engines[backend].write_async(io_file, offset=0, buffer=b"")
    empty.wait()
    assert empty.nbytes == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_tensors_round_trip_without_copies(engines, io_file, backend):
    torch = pytest.importorskip("torch")  # runtime extra; installed in the dev environment
    source = torch.randn(3001, dtype=torch.bfloat16)
    engines[backend].write(io_file, offset=8192, buffer=source)
    target = torch.empty_like(source)
    engines[backend].read(io_file, offset=8192, buffer=target)
    assert torch.equal(source.view(torch.int16), target.view(torch.int16))


def test_read_only_buffer_cannot_be_read_into(engines, io_file):
    for backend in BACKENDS:
        with pytest.raises((TypeError, BufferError)):
            engines[backend].read_async(io_file, offset=0, buffer=b"immutable")


def test_engine_settings_are_validated():
    from runtime.nvme import NvmeConfigError

    with pytest.raises(NvmeConfigError, match="block_size_bytes must be a positive multiple of 4096"):
        EngineConfig(block_size_bytes=1000)
    with pytest.raises(NvmeConfigError, match="queue_depth"):
        EngineConfig(queue_depth=0)
    with pytest.raises(NvmeConfigError, match="num_threads"):
        EngineConfig(num_threads=0)
    with pytest.raises(NvmeConfigError, match="backend must be one of"):
        EngineConfig(backend="libaio")


def test_file_is_coherent_with_plain_buffered_io(engines, io_file, tmp_path: Path):
    # Bytes written by an ordinary buffered write are what a direct read returns (dirty pages are
    # written back before a direct read).
    payload = os.urandom(8192)
    os.pwrite(io_file.buffered_fd, payload, 65536)
    target = AlignedBuffer(8192)
    engines["io_uring"].read(io_file, offset=65536, buffer=target.view)
    assert bytes(target.view) == payload
    target.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_engine_serves_many_python_threads(engines, io_file, backend):
    # Eight threads share one engine, each writing and reading back its own region 20 times.
    from concurrent.futures import ThreadPoolExecutor

    engine = engines[backend]
    region = 96 * 1024 + 123

    def worker(index: int) -> bool:
        rng = random.Random(index)
        offset = FILE_BYTES // 2 + index * region
        for _ in range(20):
            payload = rng.randbytes(region)
            engine.write(io_file, offset=offset, buffer=payload)
            back = bytearray(region)
            engine.read(io_file, offset=offset, buffer=back)
            if bytes(back) != payload:
                return False
        return True

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert list(pool.map(worker, range(8))) == [True] * 8
