"""Captured CPU graphs kept on disk, so that a new process replays its first step instead of building it.

A stale, truncated or corrupt file is a miss; `TINYVLLM_GRAPH_CACHE=0` turns it off. Chapter:
docs/phases/06-appendix-measurements.md (what a new process reuses).
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import hashlib
import os
import pickle
import platform
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinygrad import Tensor, dtypes

from tinyvllm.disk_cache import evict
from tinyvllm.kernels import cpu_threads, program_cache
from tinyvllm.kernels.cpu_graph import CPUGraph
from tinyvllm.kernels.launcher import KERNELS_DIR
from tinyvllm.kernels.scratch import shared_scratch
from tinyvllm.platforms import platform_for
from tinyvllm.tinygrad_ext import INSTALLED_VERSION
from tinyvllm.tinygrad_ext.buffers import buffer_address, is_realized
from tinyvllm.tinygrad_ext.programs import load_cpu_program
from tinyvllm.tinygrad_ext.startup import tinygrad_settings

ENABLED = os.getenv("TINYVLLM_GRAPH_CACHE", "1") != "0"
MAGIC = b"tinyvllm-graph 1\n"
MAX_BYTES = 256 << 20  # of graph files kept; the least recently used go first
PAGE = 4096  # a region keeps its address modulo a page, so every buffer in it keeps its alignment


class NotPersistable(Exception):
    """The graph holds something a new process could not rebuild from the file; it is not written."""


def cache_dir() -> Path:
    if os.getenv("TINYVLLM_GRAPH_CACHE_DIR"):
        return Path(os.environ["TINYVLLM_GRAPH_CACHE_DIR"])
    return program_cache.cache_dir().parent / program_cache.cache_dir().name.replace("programs-", "graphs-", 1)


@functools.cache
def code_identity() -> str:
    """sha256 of tinyvllm's Python source and its CPU kernels' C source: a graph is the code that traced it."""
    package = Path(__file__).resolve().parents[1]
    roots = [(str(package), ".py")] + ([(str(KERNELS_DIR / "cpu"), "")] if KERNELS_DIR is not None else [])
    h = hashlib.sha256()
    for root, suffix in roots:
        for parts in _files_below(root, suffix):
            folder = parts[-2] if len(parts) > 1 else os.path.basename(root)
            with open(os.path.join(root, *parts), "rb") as f:
                h.update(f"{folder}/{parts[-1]}".encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()


def _files_below(root: str, suffix: str) -> list[tuple[str, ...]]:
    """The files under `root` ending with `suffix`, as their path parts, sorted; os.scandir as rglob costs more than
    reading the files."""
    found, folders = [], [()]
    while folders:
        below = folders.pop()
        with os.scandir(os.path.join(root, *below)) as entries:
            for entry in entries:
                if entry.is_dir():
                    folders.append((*below, entry.name))
                elif entry.name.endswith(suffix) and entry.is_file():
                    found.append((*below, entry.name))
    return sorted(found)


@functools.cache
def cpu_identity() -> str:
    """The CPU the kernels were compiled for (clang -march=native): its model name and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))][:2]
    except OSError:
        wanted = []
    return platform.machine() + "|" + "|".join(wanted)


def simple_settings(obj: Any) -> dict[str, str]:
    """An object's plain-value attributes: the settings a traced graph may have baked in."""
    return {k: repr(v) for k, v in sorted(vars(obj).items())
            if isinstance(v, (bool, int, float, str)) or type(v).__name__ == "DType"}


def named_tensors(*objects: Any) -> dict[str, Tensor]:
    """Every Tensor reachable from `objects`, by its path ("0.layers.3.qkv_proj.data"), the same in every process."""
    found: dict[str, Tensor] = {}
    seen: set[int] = set()

    def walk(x: Any, path: str) -> None:
        if isinstance(x, Tensor):
            if is_realized(x):  # a lazy tensor has no buffer a graph could point at
                found.setdefault(path, x)
            return
        if id(x) in seen or isinstance(x, (str, bytes, int, float, bool, type(None))):
            return
        seen.add(id(x))
        if isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{path}.{i}")
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}.{k}")
        elif hasattr(x, "__dict__") and not isinstance(x, type):
            for k, v in vars(x).items():
                walk(v, f"{path}.{k}")

    for i, obj in enumerate(objects):
        walk(obj, str(i))
    return found


@dataclass
class LoadedGraph:
    """A graph read back from disk and bound to this process's buffers."""

    graph: CPUGraph
    ret: Tensor
    signature: str
    keep: list  # the regions' tensors: the table points into them

    def accepts(self, names: list, input_info: list) -> bool:
        return input_signature(names, input_info) == self.signature


def input_signature(names: list, input_info: list) -> str:
    """A call's inputs as text: their names, and per input its view, variables, dtype and device."""
    def part(x: Any) -> str:
        return x.key.hex() if hasattr(x, "key") and isinstance(x.key, bytes) else repr(x)
    return repr(names) + "|" + "|".join(",".join(part(p) if not isinstance(p, tuple) else repr([part(q) for q in p])
                                                 for p in info) for info in input_info)


class PersistedGraph:
    """Where one GraphedJit's graph lives on disk. `settings`: what besides the inputs names it; `state`: the tensors
    outside the graph it may use."""

    def __init__(self, settings: tuple, state: Callable[[], dict[str, Tensor]], device: str,
                 directory: Path | None = None):
        self.settings, self.state, self.device = settings, state, device
        self.directory = directory or cache_dir()
        self.hits = self.writes = 0
        self.skipped: str | None = None  # why the graph was not written

    def key(self, names: list, input_info: list, state: dict[str, Tensor]) -> str:
        layout = [(name, tuple(t.shape), repr(t.dtype)) for name, t in sorted(state.items())]
        return repr((self.settings, input_signature(names, input_info), layout, code_identity(), cpu_identity(),
                     INSTALLED_VERSION, tinygrad_settings(), sys.version_info[:2], cpu_threads.pool_address(),
                     sorted((k, v) for k, v in os.environ.items() if k.startswith("TINYVLLM_"))))

    def path(self, key: str) -> Path:
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()}.graph"

    # ---- reading ----

    def load(self, names: list, input_info: list) -> LoadedGraph | None:
        """The graph for these inputs if a file holds it and it fits this process; None otherwise."""
        state = self.state()
        key = self.key(names, input_info, state)
        try:
            data = self.path(key).read_bytes()
        except OSError:
            return None
        try:
            plan = read_plan(data)
            if plan["key"] != key:
                return None
            loaded = self._bind(plan, state)
        except Exception:  # build the graph again
            return None
        loaded.signature = input_signature(names, input_info)
        self.hits += 1
        try:
            os.utime(self.path(key))  # used now: the last to be evicted
        except OSError:
            pass
        return loaded

    def _bind(self, plan: dict, state: dict[str, Tensor]) -> LoadedGraph:
        table = list(plan["table"])
        programs = [load_cpu_program(lib, name) for lib, name in plan["objects"]]
        for index, which in plan["program_slots"]:
            table[index] = programs[which].addr
        state_addrs = {}
        for name, nbytes in plan["state"].items():
            t = state[name]
            if t.nbytes() != nbytes:
                raise NotPersistable(f"state {name} is {t.nbytes()} bytes, the graph was built for {nbytes}")
            state_addrs[name] = buffer_address(t)
        keep, region_addrs = [], []
        ret_region, ret_shape, ret_dtype = plan["ret"]
        # regions the graph writes before it reads them go into the scratch every graph shares (kernels/scratch.py)
        scratch_regions = [i for i, (_, _, contents) in enumerate(plan["regions"])
                           if contents is None and i != ret_region]
        scratch = shared_scratch() if scratch_regions else None
        placed = scratch.layout([plan["regions"][i][:2] for i in scratch_regions]) if scratch is not None else None
        in_scratch = dict(zip(scratch_regions, placed)) if placed is not None else {}
        for i, (start, size, contents) in enumerate(plan["regions"]):
            if i in in_scratch:
                base = in_scratch[i]
            elif i == ret_region:
                t = Tensor.empty(*ret_shape, dtype=getattr(dtypes, ret_dtype), device=self.device)
                base = buffer_address(t)
                ret = t
            else:
                t = Tensor.empty(size + PAGE, dtype=dtypes.uint8, device=self.device)
                base = buffer_address(t)
                base += (start - base) % PAGE  # the same address modulo a page as when it was captured
                if contents is not None:
                    ctypes.memmove(base, contents, size)
            if i not in in_scratch:
                keep.append(t)
            region_addrs.append(base)
        for index, kind, ref, offset in plan["relocations"]:
            table[index] = (state_addrs[ref] if kind == "state" else region_addrs[ref]) + offset
        graph = CPUGraph.from_table(table, plan["num_calls"], programs, plan["input_patches"], plan["var_patches"],
                                    scratch if in_scratch else None)
        return LoadedGraph(graph, ret, "", keep)

    # ---- writing ----

    def save(self, graph: CPUGraph, ret: Any, names: list, input_info: list) -> None:
        """Write `graph` (built with describe=True); quietly not where it cannot be."""
        state = self.state()
        try:
            plan = describe(graph, ret, state)
        except NotPersistable as e:
            self.skipped = str(e)
            return
        plan["key"] = self.key(names, input_info, state)
        payload = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        tmp = None
        try:  # a temporary file renamed into place: a reader never sees half a graph
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + hashlib.sha256(payload).digest() + payload)
            os.replace(tmp, self.path(plan["key"]))
            self.writes += 1
            evict(self.directory, "*.graph", MAX_BYTES)
        except OSError as e:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            self.skipped = f"could not write {self.directory}: {e}"


def read_plan(data: bytes) -> dict:
    """A file's plan, after checking its header and checksum (ValueError if either is wrong)."""
    if not data.startswith(MAGIC):
        raise ValueError("not a tinyvllm graph file")
    digest, payload = data[len(MAGIC):len(MAGIC) + 32], data[len(MAGIC) + 32:]
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError("graph file checksum mismatch")
    return pickle.loads(payload)


def describe(graph: CPUGraph, ret: Any, state: dict[str, Tensor]) -> dict:
    """The plan of a graph: its table with every address said by what it points at."""
    if not isinstance(ret, Tensor):
        raise NotPersistable(f"the graph returns a {type(ret).__name__}, not one Tensor")
    if not graph.calls:
        raise NotPersistable("the graph was built without describe=True")
    # the state, by address: (start, end, name); a tensor reachable under two names is kept under the first
    by_address = {buffer_address(t): (t.nbytes(), name) for name, t in sorted(state.items(), reverse=True)}
    spans = sorted(by_address.items())
    starts = [s for s, _ in spans]

    def in_state(addr: int, nbytes: int) -> tuple[str, int] | None:
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and addr + nbytes <= spans[i][0] + spans[i][1][0]:
            return spans[i][1][1], addr - spans[i][0]
        return None

    table = graph.table.tolist()
    program_slots, relocations, state_used, scratch = [], [], {}, []
    for program_index, which, buffers in graph.calls:
        program_slots.append((program_index, which))
        table[program_index] = 0
        for index, addr, nbytes, _, _ in buffers:
            if (where := in_state(addr, nbytes)) is not None:
                relocations.append((index, "state", where[0], where[1]))
                state_used[where[0]] = state[where[0]].nbytes()
            else:
                scratch.append((addr, addr + nbytes))
            table[index] = 0
    for index in graph.input_index.tolist():
        table[index] = 0
    # the graph's own buffers: overlapping ranges are one region
    regions: list[list[int]] = []
    for start, end in sorted(scratch):
        if regions and start < regions[-1][1]:
            regions[-1][1] = max(regions[-1][1], end)
        else:
            regions.append([start, end])
    region_starts = [r[0] for r in regions]

    def region_of(addr: int) -> int:
        return bisect.bisect_right(region_starts, addr) - 1

    # which regions are read before the graph writes them (a constant, or state the graph keeps to itself)
    written: dict[int, list[tuple[int, int]]] = {}
    read_first: set[int] = set()
    ever_written: set[int] = set()
    for _, _, buffers in graph.calls:
        for index, addr, nbytes, reads, _ in buffers:
            if in_state(addr, nbytes) is None:
                r = region_of(addr)
                relocations.append((index, "region", r, addr - regions[r][0]))
                if reads and not _covered(written.get(r, []), addr, addr + nbytes):
                    read_first.add(r)
        for _, addr, nbytes, _, writes in buffers:
            if writes and in_state(addr, nbytes) is None:
                r = region_of(addr)
                written.setdefault(r, []).append((addr, addr + nbytes))
                ever_written.add(r)
    if read_first & ever_written:
        raise NotPersistable("the graph keeps buffers of its own from one replay to the next")
    ret_addr = buffer_address(ret)
    ret_region = region_of(ret_addr)
    if ret_region < 0 or regions[ret_region] != [ret_addr, ret_addr + ret.nbytes()]:
        raise NotPersistable("the graph's output is not a buffer of its own")
    plan_regions = [(start, end - start, ctypes.string_at(start, end - start) if i in read_first else None)
                    for i, (start, end) in enumerate(regions)]
    return {"table": table, "num_calls": graph.num_calls, "objects": graph.objects, "program_slots": program_slots,
            "relocations": relocations, "state": state_used, "regions": plan_regions,
            "ret": (ret_region, tuple(ret.shape), ret.dtype.name),
            "input_patches": list(zip(graph.input_index.tolist(), graph.input_slot.tolist(),
                                      graph.input_offset.tolist())),
            "var_patches": [(int(i), graph.var_names[w]) for i, w in zip(graph.var_index, graph.var_which)]}


def _covered(intervals: list[tuple[int, int]], start: int, end: int) -> bool:
    """Is [start, end) inside the union of `intervals`?"""
    for s, e in sorted(intervals):
        if s > start:
            return False
        start = max(start, e)
        if start >= end:
            return True
    return start >= end


def persisted_graph(model: Any, kv_cache: Any, runner_settings: dict, *name: Any) -> PersistedGraph | None:
    """The PersistedGraph of a model runner's graph `name`, e.g. ("forward", 8); None where graphs are not kept
    (turned off, no CPU graph, or several devices)."""
    if not ENABLED or not platform_for(model.device).cpu_graph or not isinstance(model.devices, str):
        return None
    settings = (name, repr(model.config), simple_settings(model), {k: repr(v) for k, v in sorted(
        runner_settings.items())}, simple_settings(kv_cache))
    return PersistedGraph(settings, lambda: named_tensors(model, kv_cache), model.device)
