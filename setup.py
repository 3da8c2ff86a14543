"""The optional compiled decoder (pipeline/codec/binary_native.py says what it is).

Everything else is declared in pyproject.toml. Without Cython or a working C compiler the
install goes on, and the generated Python decodes (the same code, slower).
"""

from __future__ import annotations

from setuptools import Extension, setup


def compiled_decoder() -> list[Extension]:
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("dsh-pipeline: Cython is not installed; the compiled decoder is not built")
        return []
    # optional: a failing C compiler leaves a warning, not a failed install
    extension = Extension("pipeline.codec._native_events",
                          ["pipeline/codec/_native_events.pyx"], optional=True)
    modules: list[Extension] = cythonize([extension], quiet=True)
    return modules


setup(ext_modules=compiled_decoder())
