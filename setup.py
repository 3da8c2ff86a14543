"""The optional compiled decoder (pipeline/codec/binary_native.py says what it is).

Everything else is declared in pyproject.toml. Without Cython or a working C compiler the
install goes on, and the generated Python decodes (the same code, slower).
"""

from __future__ import annotations

from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildOptional(build_ext):
    """Builds each extension, or warns and leaves it out (of the outputs too) when the
    compiler fails: the ``optional`` flag alone does not cover editable installs."""

    def build_extensions(self) -> None:
        built = []
        for ext in self.extensions:
            try:
                self.build_extension(ext)
            except Exception as exc:
                print(f"dsh-pipeline: {ext.name} not built, the generated Python decodes "
                      f"instead: {exc}")
            else:
                built.append(ext)
        self.extensions: list[Any] = built


def compiled_decoder() -> list[Extension]:
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("dsh-pipeline: Cython is not installed; the compiled decoder is not built")
        return []
    # -g0: no debug information (a sixth of the size; nobody steps through generated C)
    extension = Extension("pipeline.codec._native_events",
                          ["pipeline/codec/_native_events.pyx"], optional=True,
                          extra_compile_args=["-g0"])
    modules: list[Extension] = cythonize([extension], quiet=True)
    return modules


setup(ext_modules=compiled_decoder(), cmdclass={"build_ext": BuildOptional})
