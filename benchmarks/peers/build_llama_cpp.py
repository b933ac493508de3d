"""Build llama.cpp (CPU only) and the model files it measures, so the benchmarks can run it in the same session.

    python benchmarks/peers/build_llama_cpp.py DIR      # ~10-12 min on 2 cores the first time, instant after

Every benchmark then takes `--peers DIR`. The sources are the llama.cpp that the PyPI sdist
`llama-cpp-python==0.3.36` vendors (the only copy reachable from a machine that sees only package registries),
built CPU-only for this machine's instruction set (GGML_NATIVE). The shipped GGUF (Q4_1) is requantized to F32
(the same float32 weights tinyvllm computes with) and Q8_0. Everything is cached under DIR:

    DIR/llama-cpp-python-0.3.36.tar.gz    the sdist
    DIR/llama.cpp/                        its vendor/llama.cpp, built in DIR/llama.cpp/build/bin/
    DIR/models/<stem>.{F32,Q8_0}.gguf     the requantized model files (the Q4_1 one stays where it was shipped)
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # the checkout, for tinyvllm

from tinyvllm.model.weights import default_model_path  # noqa: E402

SDIST = "llama-cpp-python==0.3.36"
TARGETS = ["llama-bench", "llama-batched-bench", "llama-server", "llama-quantize", "llama-perplexity"]
# NOTE: curl, OpenSSL and the web UI's prebuilt assets would be downloaded or linked; none is needed to measure
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF"]
FORMATS = ["F32", "Q8_0"]


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def fetch_sources(out: Path) -> Path:
    """DIR/llama.cpp, extracted from the sdist's vendor/llama.cpp."""
    src = out / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    tarballs = sorted(out.glob("llama_cpp_python-0.3.36.tar.gz")) + sorted(out.glob("llama-cpp-python-0.3.36.tar.gz"))
    if not tarballs:
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", out])
        tarballs = sorted(out.glob("llama*cpp*python-0.3.36.tar.gz"))
    with tarfile.open(tarballs[0]) as tar:
        prefix = tar.getnames()[0].split("/")[0] + "/vendor/llama.cpp/"
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for m in members:
            m.name = m.name[len(prefix):]
        tmp = out / "llama.cpp.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tar.extractall(tmp, members=[m for m in members if m.name], filter="tar")
    tmp.rename(src)
    return src


def cmake_configure(src: Path, build: Path) -> None:
    """Configure, dropping any flag this llama.cpp version rejects (cmake only warns on unused -D flags)."""
    flags = list(CMAKE_FLAGS)
    while True:
        r = subprocess.run(["cmake", "-S", src, "-B", build, *flags], capture_output=True, text=True)
        print(r.stdout[-2000:], r.stderr[-2000:], sep="\n", flush=True)
        if r.returncode == 0:
            return
        bad = [f for f in flags if f.split("=")[0][2:] in r.stderr and f != "-DCMAKE_BUILD_TYPE=Release"]
        if not bad:
            raise SystemExit("cmake configure failed (output above)")
        print(f"dropping {bad[0]}", flush=True)
        flags.remove(bad[0])


def build(src: Path, jobs: int) -> Path:
    """DIR/llama.cpp/build/bin with the five tools; nothing is rebuilt when they are all there."""
    bin_dir = src / "build" / "bin"
    if all((bin_dir / t).is_file() for t in TARGETS):
        return bin_dir
    cmake_configure(src, src / "build")
    run(["cmake", "--build", src / "build", "--config", "Release", f"-j{jobs}", "--target", *TARGETS])
    return bin_dir


def requantize(bin_dir: Path, out: Path) -> list[Path]:
    """DIR/models/<stem>.F32.gguf and .Q8_0.gguf from the shipped Q4_1 file (its Q8_0 embedding included)."""
    shipped = default_model_path()
    models = out / "models"
    models.mkdir(exist_ok=True)
    stem = shipped.name.removesuffix(".gguf").removesuffix(".Q4_1")
    made = []
    for fmt in FORMATS:
        path = models / f"{stem}.{fmt}.gguf"
        if not path.is_file():
            tmp = path.with_suffix(".partial")
            run([bin_dir / "llama-quantize", "--allow-requantize", shipped, tmp, fmt, "2"],
                stdout=subprocess.DEVNULL)
            tmp.rename(path)
        made.append(path)
    return made


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, help="where the sdist, the build and the model files go (outside the checkout)")
    p.add_argument("-j", "--jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    args = p.parse_args()
    out = args.dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    bin_dir = build(fetch_sources(out), args.jobs)
    for path in requantize(bin_dir, out):
        print("model:", path)
    print("binaries:", bin_dir)
    print(f"now: python benchmarks/bench_generate.py --peers {args.dir}")


if __name__ == "__main__":
    main()
