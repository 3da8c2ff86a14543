"""The optional compiled decoder (pipeline/codec/binary_native.py says what it is), and the
Avro schemas carried in the wheel.

Everything else is declared in pyproject.toml. Without Cython or a working C compiler the
install goes on, and the generated Python decodes (the same code, slower). The schemas stay at
the repository's top (``schemas/``); a built wheel carries a copy in ``pipeline/schemas/``
(:mod:`pipeline.codec.schema_files` reads that copy, or the repository's in an editable install).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

SCHEMAS = Path(__file__).resolve().parent / "schemas"


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


class BuildWithSchemas(build_py):
    """Copies the repository's ``schemas/`` into the built package as ``pipeline/schemas/``
    (not for an editable install: that reads the repository's folder itself)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / "pipeline" / "schemas"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(SCHEMAS, target)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs: list[str] = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        target = Path(self.build_lib) / "pipeline" / "schemas"
        return outputs + [str(target / path.relative_to(SCHEMAS))
                          for path in sorted(SCHEMAS.rglob("*")) if path.is_file()]


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


setup(ext_modules=compiled_decoder(),
      cmdclass={"build_ext": BuildOptional, "build_py": BuildWithSchemas})
