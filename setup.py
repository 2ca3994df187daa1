"""The native kernels (runtime/native/kernels.c), compiled at install.

Everything else is declared in pyproject.toml. The extension is optional: where no C
compiler is present (or the CPU family is not x86-64) the install still succeeds, and
the runtime runs every artifact on ONNX Runtime, saying why `kernels: native` is not
available.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "llmopt.runtime.native._kernels",
    sources=["runtime/native/kernels.c"],
    extra_compile_args=["-O3", "-fopenmp", "-std=c11"],
    extra_link_args=["-fopenmp"],
    optional=True,
)])
