"""What a new process reuses from earlier ones (tinyvllm/kernels/program_cache.py, graph_cache.py): the default
device tinygrad chose, the CPU device's helper programs, and captured graphs. Each must be reused only where it
still holds, and give exactly what rebuilding it gives."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_CONFIG, write_tiny_model

from tinyvllm import disk_cache, tinygrad_ext
from tinyvllm.tinygrad_ext import buffers, startup
from tinyvllm.kernels import graph_cache, program_cache


def test_the_default_device_is_remembered_and_probed_again_when_the_machine_changes(tmp_path, monkeypatch):
    path = tmp_path / "default_device.json"
    probes = []

    def probe():
        probes.append(1)
        return "CPU"

    settled = []
    monkeypatch.setattr(program_cache, "chosen_default_device", lambda: None)
    monkeypatch.setattr(program_cache, "choose_default_device", probe)
    monkeypatch.setattr(program_cache, "set_default_device", settled.append)
    monkeypatch.setattr(program_cache, "without_accelerator", lambda fingerprint: False)  # as on a GPU machine
    assert program_cache.settle_default_device(path) == "CPU" and len(probes) == 1  # nothing remembered: probe
    assert json.loads(path.read_text())["device"] == "CPU"
    assert program_cache.settle_default_device(path) == "CPU" and len(probes) == 1  # remembered: no probe
    assert settled == ["CPU"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # the machine looks different: probe again
    assert program_cache.settle_default_device(path) == "CPU" and len(probes) == 2
    path.write_text("{not json")  # a corrupt file: probe again
    assert program_cache.settle_default_device(path) == "CPU" and len(probes) == 3


def test_a_machine_without_an_accelerator_settles_on_the_cpu_without_probing(tmp_path, monkeypatch):
    bare = {"platform": "linux", "tinygrad": "0", "dev_nodes": [], "env": {"LD_LIBRARY_PATH": "/opt/lib"}}
    assert program_cache.without_accelerator(bare)
    assert not program_cache.without_accelerator({**bare, "dev_nodes": ["nvidiactl"]})
    assert not program_cache.without_accelerator({**bare, "env": {"CUDA_VISIBLE_DEVICES": "0"}})
    assert not program_cache.without_accelerator({**bare, "platform": "darwin"})  # Metal needs no device node
    monkeypatch.setattr(program_cache, "chosen_default_device", lambda: None)
    monkeypatch.setattr(program_cache, "machine_fingerprint", lambda: bare)
    monkeypatch.setattr(program_cache, "choose_default_device", lambda: pytest.fail("probed"))
    settled = []
    monkeypatch.setattr(program_cache, "set_default_device", settled.append)
    assert program_cache.settle_default_device(tmp_path / "default_device.json") == "CPU" and settled == ["CPU"]


def test_the_remembered_device_is_what_tinygrad_probes():
    from tinygrad import Device

    fingerprint = program_cache.machine_fingerprint()
    assert fingerprint["tinygrad"] == tinygrad_ext.INSTALLED_VERSION
    assert tinygrad_ext.installed_version() == importlib.metadata.version("tinygrad")  # read without it
    assert startup.chosen_default_device() in (None, Device.DEFAULT)




def test_the_packages_empty_is_tinygrads():
    """tinygrad_ext.buffers.empty builds what Tensor.empty builds for a shape of ints (without its no-op shrink): a new
    buffer of that size reshaped to the shape; over memory of its own (tensor_over_memory), it reads that memory."""
    import numpy as np
    from tinygrad import Tensor, dtypes

    for shape, dtype in [((3, 4), dtypes.float32), ((7,), dtypes.uint8), ((2, 3, 5), dtypes.int32),
                         ((3, 4), dtypes.uint8),
                         ((1, 1), dtypes.float32)]:  # a shape again: its reshape's sources come from the memo
        ours, theirs = buffers.empty(shape, dtype, None), Tensor.empty(*shape, dtype=dtype)
        for a, b in [(ours.uop, theirs.uop), (ours.uop.base, theirs.uop.base)]:
            assert (a.op, a.shape, a.dtype, a.device, a.arg if a.op.name == "RESHAPE" else None) == \
                (b.op, b.shape, b.dtype, b.device, b.arg if b.op.name == "RESHAPE" else None)
        assert ours.uop.src[1:] == theirs.uop.src[1:]  # the shape's uops: the same objects (tinygrad keeps one each)
        assert ours.uop.buffer.size == theirs.uop.buffer.size and ours.uop.buffer is not theirs.uop.buffer
    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = buffers.tensor_over_memory(host.ctypes.data, (3, 4), dtypes.float32, None, owner=host)
    np.testing.assert_array_equal((t * 2).numpy(), host * 2)

RENDERERS_CHILD = """
import sys
from tinyvllm.kernels import program_cache
program_cache.install(device="CPU")
from tinygrad import Device, Tensor
renderer = type(Device["CPU"].renderer)  # DEV=CPU:X86 picks a deferred renderer: the real class
result = (Tensor([1.0, 2.0]) * 3).tolist()
mesa_before = "tinygrad.runtime.autogen.mesa" in sys.modules
from tinygrad.renderer.nir import NAKRenderer  # any other name: the real module, imported now
print(renderer.__module__, renderer.__name__, result, mesa_before, NAKRenderer.__module__,
      "tinygrad.runtime.autogen.mesa" in sys.modules)
"""


def test_the_cpu_renderers_nobody_asked_for_are_imported_on_first_use(tmp_path):
    """The CPU device's module imports without Mesa's NIR (LVP) and x86 renderers' modules; the renderer DEV picks
    and any name read from such a module are the real ones (a new process: this one has opened the device)."""
    env = {**os.environ, "TINYVLLM_CACHE_DIR": str(tmp_path), "DEV": "CPU:X86", "TINYVLLM_PROGRAM_CACHE": "1"}
    out = subprocess.run([sys.executable, "-c", RENDERERS_CHILD], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["tinygrad.renderer.isa.x86", "X86Renderer", "[3.0,", "6.0]", "False", "tinygrad.renderer.nir",
                   "True"]


@pytest.mark.skipif(sys.platform != "linux", reason="the quick search is Linux's; elsewhere tinygrad's own runs")
def test_the_quick_library_search_finds_what_tinygrads_finds(tmp_path, monkeypatch):
    """tinygrad_ext.startup._findlib returns what tinygrad's DLL.findlib returns: the system's libraries, absent ones,
    absolute paths, and a directory first on LD_LIBRARY_PATH whose first fitting name is a linker script (skipped)
    and whose next is an ELF library (taken, ahead of the system's)."""
    from tinygrad.runtime.support.c import DLL

    tinygrads = startup.TINYGRAD_FINDLIB or DLL.findlib  # this process may have swapped DLL.findlib for the quick one
    libs = tmp_path / "libs"
    libs.mkdir()
    (libs / "libm.so").write_text("GROUP ( /lib/libm.so.6 )\n")  # a linker script, as /usr/lib has
    (libs / "libm.so.6").write_bytes(b"\x7fELF" + bytes(60))
    (libs / "libmx.so").write_bytes(b"\x7fELF")  # a name that does not fit lib{m}.so[.N]
    cases = [("libc", ["c"], []), ("rt", ["gcc_s"], []), ("m", ["m"], []), ("mesa", ["tinymesa"], [str(tmp_path)]),
             ("nothing", ["no-such-library"], []), ("abs", [str(libs / "libm.so.6")], []), ("m", ["m"], [str(libs)])]
    for env in ("", str(libs)):
        monkeypatch.setenv("LD_LIBRARY_PATH", env)
        for nm, paths, extra in cases:
            assert startup._findlib(nm, paths, extra) == tinygrads(nm, paths, extra), (nm, paths, env)
    assert startup._findlib("m", ["m"]) == str(libs / "libm.so.6")  # LD_LIBRARY_PATH is searched first

# ---- captured graphs kept on disk (tinyvllm/kernels/graph_cache.py) ----

PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 140)), [7] * 9]  # bucket 8 and bucket 64 prefills, then decodes


@pytest.fixture()
def graph_dir(tmp_path, monkeypatch):
    """Graphs kept in a directory of this test's own, whatever TINYVLLM_GRAPH_CACHE says for the suite."""
    monkeypatch.setenv("TINYVLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TINYVLLM_GRAPH_CACHE_DIR", raising=False)
    monkeypatch.setattr(graph_cache, "ENABLED", True)
    return tmp_path / graph_cache.cache_dir().name


def greedy_tokens(model_dir, graphs: bool = True) -> tuple[list[list[int]], list]:
    """Each prompt's 6 greedy tokens on a new engine, one request after the other; and the engine's persisted
    graphs. graphs=False: no graph is read or written (what the engine did before graphs were kept)."""
    from tinyvllm.engine.generator import Generator
    from tinyvllm.sampling_params import SamplingParams

    with pytest.MonkeyPatch.context() as m:
        m.setattr(graph_cache, "ENABLED", graphs and graph_cache.ENABLED)
        gen = Generator(model_dir, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                        kv_cache_memory="16MiB", enable_prefix_caching=False)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        tokens = [gen.generate(p, params).token_ids for p in PROMPTS]
    runner = gen.engine.model_runner
    jits = list(runner._jits.values()) + list(runner._sampler_jits.values())
    return tokens, [j.persist for j in jits if j.persist is not None]


def test_a_persisted_graph_gives_the_tokens_of_a_built_one(tiny_model_dir, graph_dir):
    want, _ = greedy_tokens(tiny_model_dir, graphs=False)
    first, persisted = greedy_tokens(tiny_model_dir)  # builds every graph and writes it
    assert first == want
    assert sum(p.writes for p in persisted) >= 4 and not any(p.skipped for p in persisted), \
        [p.skipped for p in persisted]
    files = sorted(graph_dir.glob("*.graph"))
    again, persisted = greedy_tokens(tiny_model_dir)  # a new engine: every graph read back, none built
    assert again == want
    assert sum(p.hits for p in persisted) == len(files) and sum(p.writes for p in persisted) == 0


def test_a_graph_read_back_runs_its_intermediates_in_the_shared_scratch(tiny_model_dir, graph_dir):
    """The regions a graph writes before it reads go into the scratch every graph shares (kernels/scratch.py), as a
    graph built in this process does; its output keeps a buffer of its own."""
    from tinyvllm.engine.generator import Generator
    from tinyvllm.kernels import scratch
    from tinyvllm.sampling_params import SamplingParams

    if scratch.shared_scratch() is None:
        pytest.skip("no shared scratch on this system")
    want, _ = greedy_tokens(tiny_model_dir)  # builds and writes the graphs
    gen = Generator(tiny_model_dir, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                    kv_cache_memory="16MiB", enable_prefix_caching=False)
    got = [gen.generate(p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)).token_ids for p in PROMPTS]
    loaded = [j.loaded for j in gen.engine.model_runner._jits.values() if j.loaded]
    assert got == want and loaded
    shared = scratch.shared_scratch()
    for graph in loaded:
        assert graph.graph.scratch is shared
        assert not shared.base <= buffers.buffer_address(graph.ret) < shared.base + shared.size


def test_a_corrupt_or_foreign_graph_file_is_rebuilt(tiny_model_dir, graph_dir):
    want, _ = greedy_tokens(tiny_model_dir)
    files = sorted(graph_dir.glob("*.graph"))
    data = files[0].read_bytes()
    files[0].write_bytes(data[:-100] + bytes(b ^ 0xFF for b in data[-100:]))  # flipped bits: checksum mismatch
    files[1].write_bytes(data[: len(data) // 2])  # truncated
    got, persisted = greedy_tokens(tiny_model_dir)
    assert got == want
    assert sum(p.writes for p in persisted) == 2 and sum(p.hits for p in persisted) == len(files) - 2


def test_other_weights_reuse_the_graph_and_another_config_does_not(tmp_path, tiny_model_dir, graph_dir):
    greedy_tokens(tiny_model_dir)  # the graphs of TINY_CONFIG
    other_weights = write_tiny_model(tmp_path / "other-weights", TINY_CONFIG, seed=5)
    want, _ = greedy_tokens(other_weights, graphs=False)
    got, persisted = greedy_tokens(other_weights)  # same layout: the same graphs, bound to these weights
    assert got == want and sum(p.hits for p in persisted) > 0 and sum(p.writes for p in persisted) == 0
    other_config = write_tiny_model(tmp_path / "other-config", dataclasses.replace(TINY_CONFIG, rms_norm_eps=1e-2))
    want, _ = greedy_tokens(other_config, graphs=False)
    got, persisted = greedy_tokens(other_config)  # the epsilon is compiled into a kernel: new graphs
    assert got == want and sum(p.hits for p in persisted) == 0 and sum(p.writes for p in persisted) > 0


def test_the_state_a_graph_finds_must_fit_it(tiny_model_dir, graph_dir):
    _, persisted = greedy_tokens(tiny_model_dir)
    forward = next(p for p in persisted if p.settings[0][0] == "forward")
    state = forward.state()
    plans = [graph_cache.read_plan(path.read_bytes()) for path in sorted(graph_dir.glob("*.graph"))]
    plan = next(plan for plan in plans if plan["state"])  # the forward graph's (the sampler's binds no state)
    name = next(iter(plan["state"]))
    plan["state"][name] += 4  # as if the file had been written for a bigger tensor of that name
    with pytest.raises(graph_cache.NotPersistable):
        forward._bind(plan, state)


TEST_PATH = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
CHILD = """
import json, os, sys
sys.path[:0] = sys.argv[2:]  # tests/kernels/ and tests/ (conftest)
import test_cold_start
tokens, persisted = test_cold_start.greedy_tokens(sys.argv[1])
print(json.dumps({"tokens": tokens, "hits": sum(p.hits for p in persisted),
                  "writes": sum(p.writes for p in persisted)}))
"""


def test_a_new_process_reads_the_graphs_back(tiny_model_dir, tmp_path):
    """What the cache is for: a second process (its own thread pool, device and program loads) reads every graph
    the first one wrote, and gives the same tokens."""
    env = {**os.environ, "TINYVLLM_CACHE_DIR": str(tmp_path), "TINYVLLM_GRAPH_CACHE_DIR": str(tmp_path / "graphs"),
           "TINYVLLM_GRAPH_CACHE": "1"}  # both processes, this test's own directory
    runs = [json.loads(subprocess.run([sys.executable, "-c", CHILD, str(tiny_model_dir), *TEST_PATH],
                                      env=env, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
            for _ in range(2)]
    assert runs[0]["writes"] >= 4 and runs[0]["hits"] == 0
    assert runs[1]["hits"] == runs[0]["writes"] and runs[1]["writes"] == 0
    assert runs[1]["tokens"] == runs[0]["tokens"]


def test_the_graph_directory_keeps_the_most_recently_used_files(tmp_path):
    for i, name in enumerate(["old", "used", "new"]):
        (tmp_path / f"{name}.graph").write_bytes(b"x" * 100)
        os.utime(tmp_path / f"{name}.graph", (1000 + i, 1000 + i))
    os.utime(tmp_path / "used.graph", (2000, 2000))  # read after the others were written
    disk_cache.evict(tmp_path, "*.graph", 200)
    assert sorted(p.stem for p in tmp_path.glob("*.graph")) == ["new", "used"]


# ---- the tokenizer's tables kept on disk (tinyvllm/model/tokenizer_cache.py) ----

def test_the_tokenizer_is_read_back_and_rebuilt_when_stale_or_corrupt(tmp_path, tiny_model_dir, monkeypatch):
    import shutil

    from tinyvllm.model import tokenizer as tokenizer_module
    from tinyvllm.model import tokenizer_cache

    monkeypatch.setenv("TINYVLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tokenizer_cache, "ENABLED", True)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, model_dir / name)
    builds = []
    build = tokenizer_module.load_tokenizer
    monkeypatch.setattr(tokenizer_module, "load_tokenizer", lambda path: builds.append(path) or build(path))
    text = "Hello<|im_end|> world, 12345 ünïcode 😀\n\n  spaces"

    want = build(model_dir)
    first = tokenizer_cache.load_tokenizer(model_dir)  # built, then written
    [file] = (tmp_path / "cache" / "tokenizers").glob("*.tokenizer")
    again = tokenizer_cache.load_tokenizer(model_dir)  # read back: not built
    assert len(builds) == 1
    for tok in (first, again):
        assert tok.encode(text) == want.encode(text) and tok.decode(want.encode(text)) == want.decode(want.encode(text))
        assert (tok.vocab_size, tok.stop_token_ids, tok.bos_token_id, tok.eos_token_id, tok.chat_template) == \
            (want.vocab_size, want.stop_token_ids, want.bos_token_id, want.eos_token_id, want.chat_template)

    data = file.read_bytes()
    file.write_bytes(data[:-100] + bytes(b ^ 0xFF for b in data[-100:]))  # flipped bits: checksum mismatch
    assert tokenizer_cache.load_tokenizer(model_dir).encode(text) == want.encode(text) and len(builds) == 2
    assert file.read_bytes() == data  # written again
    file.write_bytes(data[: len(data) // 2])  # truncated
    assert tokenizer_cache.load_tokenizer(model_dir).encode(text) == want.encode(text) and len(builds) == 3

    # stale: a tokenizer file changed, or the tokenizer's code changed: another key, rebuilt
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    changed = tokenizer_cache.load_tokenizer(model_dir)
    assert len(builds) == 4 and changed.add_bos_token and changed.encode(text)[0] == want.bos_token_id
    assert tokenizer_cache.load_tokenizer(model_dir).add_bos_token and len(builds) == 4
    monkeypatch.setattr(tokenizer_cache, "code_identity", lambda: "other code")
    assert tokenizer_cache.load_tokenizer(model_dir).add_bos_token and len(builds) == 5


# ---- a GGUF's parsed header kept on disk (tinyvllm/model/gguf.py) ----

def test_the_gguf_header_is_read_back_and_parsed_again_when_stale_or_corrupt(tmp_path, monkeypatch):
    """A second process (here: the in-memory memo cleared) reads the header back, string arrays over the file
    included; a corrupt or truncated file, a rewritten GGUF (size, mtime) or a changed parser is parsed again."""
    import numpy as np

    from tinyvllm.model import gguf, gguf_header_cache
    from tinyvllm.model.gguf_writer import TensorData, write_gguf

    monkeypatch.setenv("TINYVLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_header_cache, "HEADER_CACHE", True)
    parses = []
    parse = gguf._parse_header
    monkeypatch.setattr(gguf, "_parse_header", lambda path, buf: parses.append(path) or parse(path, buf))
    model = tmp_path / "m.gguf"

    def write(tokens: list[str]) -> None:
        metadata = {"general.architecture": "llama", "tokenizer.ggml.tokens": tokens, "llama.block_count": 2,
                    "tokenizer.ggml.scores": [0.5] * len(tokens)}
        write_gguf(model, metadata, [TensorData("w", (2, 3), 0, np.arange(6, dtype=np.float32).reshape(2, 3))])

    def opened() -> gguf.GGUFFile:
        gguf._read_header.cache_clear()  # what a new process starts with
        return gguf.GGUFFile(model)

    write(["a", "b", "ünï", ""])
    first = opened()  # parsed, then written
    [file] = (tmp_path / "cache" / "gguf-headers").glob("*.header")
    again = opened()  # read back: not parsed
    assert len(parses) == 1 and isinstance(again.metadata["tokenizer.ggml.tokens"], gguf.StringArray)
    assert again.metadata == first.metadata and again.tensors == first.tensors
    assert list(again.metadata["tokenizer.ggml.tokens"]) == ["a", "b", "ünï", ""]
    np.testing.assert_array_equal(again.raw("w", 24).view(np.float32), np.arange(6, dtype=np.float32))

    data = file.read_bytes()
    file.write_bytes(data[:-10] + bytes(b ^ 0xFF for b in data[-10:]))  # flipped bits: checksum mismatch
    assert opened().tensors == first.tensors and len(parses) == 2
    assert file.read_bytes() == data  # written again
    file.write_bytes(data[: len(data) // 2])  # truncated
    assert opened().metadata == first.metadata and len(parses) == 3

    write(["a", "b", "c", "dd", "eee"])  # the model rewritten: another size, another key
    assert list(opened().metadata["tokenizer.ggml.tokens"]) == ["a", "b", "c", "dd", "eee"] and len(parses) == 4
    assert list(opened().metadata["tokenizer.ggml.tokens"]) == ["a", "b", "c", "dd", "eee"] and len(parses) == 4
    monkeypatch.setattr(gguf_header_cache, "_code_identity", lambda: "other code")  # the parser changed
    assert opened().metadata["llama.block_count"] == 2 and len(parses) == 5


def _mapped_rss(path) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if "-" in line.split(" ", 1)[0]:  # a mapping's first line: its address range ... its path
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(sys.platform != "linux", reason="madvise's advice is Linux's")
def test_a_gguf_weight_mapped_in_then_let_go_reads_the_same_and_leaves_the_resident_set(tmp_path):
    """populate maps a weight's pages in (the first step reads them without a fault); let_go, once its bytes were
    copied out, drops them from the process, so a fused weight is not counted twice; the bytes read are the same."""
    import numpy as np

    from tinyvllm.model import gguf
    from tinyvllm.model.gguf_writer import TensorData, write_gguf

    w = np.random.default_rng(0).standard_normal((1024, 4096)).astype(np.float32)  # 16 MiB
    path = tmp_path / "m.gguf"
    write_gguf(path, {"general.architecture": "llama"}, [TensorData("w", w.shape, 0, w)])
    raw = gguf.GGUFFile(path).raw("w", w.nbytes)
    gguf.populate([raw])
    assert _mapped_rss(path) >= w.nbytes
    gguf.let_go([raw])
    assert _mapped_rss(path) <= 2 * 4096  # the header's page and the last partial one
    np.testing.assert_array_equal(raw.view(np.float32).reshape(w.shape), w)
    gguf.let_go([np.zeros(4096, np.uint8)])  # memory of its own: left alone
