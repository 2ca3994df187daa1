"""The native kernels (runtime/native/kernels.c), compiled at install.

Everything else is declared in pyproject.toml. The extension is optional: where no C
compiler is present (or the CPU family is not x86-64) the install still succeeds, and
the runtime runs every artifact on ONNX Runtime, saying why `kernels: native` is not
available.
"""

from pathlib import Path

from setuptools import Extension, setup

NATIVE = Path("runtime/native")
# kernels.c includes every other C file there (one translation unit): they are its
# dependencies, so that editing one rebuilds the extension, never sources of their own.
PARTS = sorted(str(p) for p in [*NATIVE.glob("*.c"), *NATIVE.glob("*.h")] if p.name != "kernels.c")

setup(ext_modules=[Extension(
    "llmopt.runtime.native._kernels",
    sources=[str(NATIVE / "kernels.c")],
    depends=PARTS,
    extra_compile_args=["-O3", "-fopenmp", "-std=c11"],
    extra_link_args=["-fopenmp"],
    optional=True,
)])
