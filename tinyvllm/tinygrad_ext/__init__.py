"""Every use of tinygrad's internals, in one package (docs/phases/01-appendix-tinygrad-internals.md)."""

from __future__ import annotations

import os
import warnings

import tinygrad


def installed_version() -> str:
    """tinygrad's version, from its dist-info directory's name (importlib.metadata, slow to import, as a fallback)."""
    site = os.path.dirname(os.path.dirname(os.path.abspath(tinygrad.__file__)))
    found = [n for n in os.listdir(site) if n.startswith("tinygrad-") and n.endswith(".dist-info")]
    if len(found) == 1:
        return found[0].removeprefix("tinygrad-").removesuffix(".dist-info")
    from importlib.metadata import version

    return version("tinygrad")


TINYGRAD_VERSION = "0.14.0"  # the one this package was written against (pyproject.toml pins it)
INSTALLED_VERSION = installed_version()  # the caches' keys carry it
if INSTALLED_VERSION != TINYGRAD_VERSION:
    warnings.warn(f"tinyvllm was written for tinygrad {TINYGRAD_VERSION}, this is tinygrad {INSTALLED_VERSION}: "
                  "its internals may have moved (`python -m tinyvllm.tinygrad_ext.internals` lists what is missing); "
                  "speed fixes are off", RuntimeWarning, stacklevel=2)
