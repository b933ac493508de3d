"""The wheel carries the kernels: built, installed into a fresh venv, and used from outside the repository.

The kernel sources live at the top of the repository (`kernels/`); pyproject.toml maps that folder into the
package as `tinyvllm.kernel_sources`. An install without them would run every kernel on tinygrad's portable
path, correct but several times slower, so this checks the real thing:

    copy of the sources --pip wheel--> tinyvllm-*.whl --pip install--> fresh venv (its dependencies: a .pth
    file naming this venv's site-packages) --subprocess, cwd outside the repository--> which tinyvllm, which
    kernel files, and does the matmul kernel run; and is the `tinyvllm` command on the venv's PATH, with its verbs

The wheel is built from a copy, so the checkout gets no build/ folder. Site-packages named by a .pth line
are only put on sys.path (their own .pth files are not run), so this venv's editable install of tinyvllm
cannot shadow the wheel; the subprocess checks that anyway.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from tinyvllm.kernels import launcher

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["pyproject.toml", "README.md", "tinyvllm", "kernels"]  # what the build reads

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX venv layout")

CHECK = """
import sys
from pathlib import Path

import numpy as np
from tinygrad import Tensor

import tinyvllm
from tinyvllm.attention import kernel_backend
from tinyvllm.kernels import launcher
from tinyvllm.kernels.linear import linear, uses_kernel

site = Path(sys.argv[1]).resolve()
assert Path(tinyvllm.__file__).resolve().is_relative_to(site), f"tinyvllm imported from {tinyvllm.__file__}"
assert launcher.KERNELS_DIR == site / "tinyvllm" / "kernel_sources", launcher.KERNELS_DIR
assert launcher.has_kernel("matmul", "CPU") and kernel_backend.has_kernel("CPU")
assert launcher.kernel_path("paged_attention", "CPU").resolve().is_relative_to(site)
source = launcher.kernel_source("matmul", "CPU", {"TV_M": 2, "TV_N": 24, "TV_K": 16, "TV_POOL_ADDR": 0})
assert "TV_KERNEL matmul(" in source and "struct tv_pool" in source  # threadpool.h pasted in from the package
rng = np.random.default_rng(0)
x, w = rng.standard_normal((2, 16), dtype=np.float32), rng.standard_normal((24, 16), dtype=np.float32)
assert uses_kernel(Tensor(x), Tensor(w))
np.testing.assert_allclose(linear(Tensor(x), Tensor(w)).numpy(), x @ w.T, rtol=1e-5, atol=1e-5)
print("kernels from", launcher.KERNELS_DIR)
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools")
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-index", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(work / "dist"), str(src)], check=True, timeout=300)
    (built,) = (work / "dist").glob("tinyvllm-*.whl")
    return built


def test_wheel_holds_every_module_and_kernel(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = [str(p.relative_to(ROOT)) for p in (ROOT / "tinyvllm").rglob("*.py") if "__pycache__" not in p.parts]
    kernels = [f"tinyvllm/kernel_sources/{p.relative_to(ROOT / 'kernels')}" for p in (ROOT / "kernels").rglob("*")
               if p.is_file()]
    page = [str(p.relative_to(ROOT)) for p in (ROOT / "tinyvllm" / "api" / "static").iterdir()]  # the dashboard
    missing = [m for m in modules + kernels + page if m not in names]
    assert not missing, f"the wheel lacks {missing} (pyproject.toml: [tool.setuptools] packages, package-data)"
    assert "tinyvllm/kernel_sources/cpu/matmul.c" in kernels and "tinyvllm/api/static/dashboard.js" in page


def test_installed_wheel_runs_its_own_kernels(wheel: Path, tmp_path: Path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))  # this venv: numpy, tinygrad...
    Path(site, "project_dependencies.pth").write_text("".join(f"{p}\n" for p in ours))
    # pip runs inside the new venv's Python (--python): with a checkout on PYTHONPATH it would find the checkout's
    # own tinyvllm.egg-info (left by an editable install), take the package as installed, and skip the wheel
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index", "--no-deps",
                    "--disable-pip-version-check", str(wheel)], check=True, timeout=300, env=env)
    env["DEV"] = "CPU"  # the kernels' device, whatever this run was given
    result = subprocess.run([str(python), "-c", CHECK, site], check=False, cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no kernel sources" not in result.stderr

    # the console script ([project.scripts]): its verbs, the server's flags, and bench's clear error outside a clone
    command = env_dir / "bin" / "tinyvllm"
    result = subprocess.run([str(command), "--help"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and all(verb in result.stdout for verb in ("serve", "generate", "chat", "bench",
                                                                             "quantize", "perplexity")), result.stderr
    result = subprocess.run([str(command), "serve", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "usage: tinyvllm serve" in result.stdout and "--port" in result.stdout
    result = subprocess.run([str(command), "bench", "latency"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "source repository" in result.stderr


def test_missing_kernel_sources_warn(tmp_path: Path):
    with pytest.warns(RuntimeWarning, match="no kernel sources"):
        assert launcher.find_kernels_dir([tmp_path / "nowhere"]) is None
    assert launcher.find_kernels_dir([tmp_path / "nowhere", ROOT / "kernels"]) == ROOT / "kernels"
