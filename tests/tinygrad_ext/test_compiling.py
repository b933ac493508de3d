"""Compiling a first request's kernels sooner (tinyvllm/tinygrad_ext/compiling.py): `<immintrin.h>` read from a
precompiled header gives the object parsing it gives, byte for byte; a header clang refuses is built again and a
wrong source still fails with clang's message; the compile pool's workers stay; a kernel handed to the pool ahead
of its graph's lowering is found compiled, not compiled twice."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import uuid

import pytest
from tinygrad import Device
from tinygrad.helpers import diskcache_get

from tinyvllm.tinygrad_ext import compiling

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or not shutil.which("clang"),
                                reason="the precompiled header is of x86's intrinsics, built by clang")


def source(tag: str = "") -> str:
    """A kernel that includes the header (an SSE add of four floats); `tag` makes it a source of its own."""
    return (f"{compiling.PCH_INCLUDE}\n/* {tag} */\n"
            "void add4(float* out, const float* a, const float* b) {\n"
            "  _mm_storeu_ps(out, _mm_add_ps(_mm_loadu_ps(a), _mm_loadu_ps(b)));\n}\n")


@pytest.fixture
def compiler():
    c = Device["CPU"].compiler
    if not isinstance(c, compiling.ClangCompiler):
        pytest.skip("the CPU device compiles with another compiler than clang")
    return c


@pytest.fixture
def pch_dir(tmp_path, monkeypatch):
    """This process compiling against a PCH in a directory of the test's own, as before afterwards."""
    monkeypatch.setattr(compiling.ClangCompiler, "compile", compiling.ClangCompiler.compile)
    monkeypatch.setattr(compiling, "_pch_dir", compiling._pch_dir)
    compiling.use_precompiled_header(tmp_path)
    return tmp_path


def test_the_header_read_from_the_pch_gives_the_same_object_byte_for_byte(compiler, tmp_path):
    pch = compiling.precompiled_header(compiler, tmp_path)
    assert pch is not None and pch.is_file() and pch.parent == tmp_path
    with_pch = compiling.compile_against(compiler, source(), pch)
    assert with_pch is not None, "clang refused a PCH built with the flags tinygrad compiles with"
    assert with_pch == compiling._plain_compile(compiler, source())  # the same flags, the same machine code
    assert compiling.precompiled_header(compiler, tmp_path) == pch  # built once


def test_a_pch_clang_refuses_is_built_again_and_the_kernel_still_compiles(compiler, pch_dir):
    pch = compiling.precompiled_header(compiler, pch_dir)
    pch.write_bytes(b"not a precompiled header")  # as a PCH another clang wrote
    assert compiling.compile_against(compiler, source("refused"), pch) is None
    assert compiler.compile(source("refused")) == compiling._plain_compile(compiler, source("refused"))
    assert compiling.compile_against(compiler, source("refused"), pch) is not None  # built again, and read


def test_a_wrong_source_fails_with_clangs_message_and_leaves_the_pch_alone(compiler, pch_dir):
    pch = compiling.precompiled_header(compiler, pch_dir)
    before = pch.read_bytes()
    with pytest.raises(subprocess.CalledProcessError):
        compiler.compile(compiling.PCH_INCLUDE + "\nvoid f( {")
    assert pch.read_bytes() == before


def test_sources_without_the_header_compile_as_tinygrad_compiles_them(compiler, pch_dir, monkeypatch):
    ran = []
    monkeypatch.setattr(compiling, "compile_against", lambda *a: ran.append(a))
    plain = "void triple(int* out, int a) { out[0] = a * 3; }"
    assert compiler.compile(plain) == compiling._plain_compile(compiler, plain) and ran == []


def test_the_pool_keeps_its_workers_and_a_kernel_handed_ahead_is_found_compiled(compiler, pch_dir, monkeypatch):
    compiling.worker.terminate_worker_pool()  # one an earlier test's tinygrad made before the engine was installed
    pool = compiling.compile_pool()
    if pool is None:
        pytest.skip("PARALLEL=0: kernels compile in this process")
    pids = set(pool.starmap(os.getpid, [()] * 40, chunksize=1))  # tinygrad's own replaces a worker after 16 tasks
    assert len(pids) <= compiling.PARALLEL.value

    src = source(uuid.uuid4().hex)
    compiling.compile_ahead(compiler, src)  # not while tracing a graph: lowered at once, nothing to do ahead
    assert src not in compiling._ahead
    monkeypatch.setattr(compiling.realize, "capturing", [object()])  # as TinyJit is while it captures
    compiling.compile_ahead(compiler, src)
    compiling._ahead[src].get(timeout=120)
    lib = diskcache_get(compiler.cachekey, src)
    assert lib == compiling._plain_compile(compiler, src)
    # lowering it now (as a graph of one kernel does, in this process) takes the pool's object: no clang runs
    monkeypatch.setattr(compiling, "compile_against", lambda *a: pytest.fail("compiled again"))
    monkeypatch.setattr(compiling, "_plain_compile", lambda *a: pytest.fail("compiled again"))
    assert compiler.compile(src) == lib
