"""The compiled (Cython) build of the session-event decoder, and the rule for using it.

Decoding is the hot path of every consumer, and the generated decoders of
:mod:`pipeline.codec.binary` are straight-line Python: compiled, the same source takes
less than half the CPU time. ``_native_events.pyx`` is the generated decoder source of
today's session-event schema as Cython (:func:`native_source`); the install compiles it
when Cython and a C compiler are at hand (``setup.py``), and goes on without it otherwise.
``python -m pipeline.codec.native_pyx`` rewrites it from the schema and the generator;
a test fails when the committed file is not what they generate.

The rule: a compiled schema uses the compiled functions only when their key, the hash of
the decoder source, of the constants it reads and of the source of the helpers it copies,
equals its own, i.e. when they are the very code it would execute; it then hands the
compiled module the same helpers and constants. Otherwise (another schema or version, a
generator changed since the build, no compiler at install time) the generated Python
decodes. The Cython text differs from the Python in three ways only: C types (``data`` is
``bytes``, callers pass bytes; positions, a long's first two bytes, union branch indexes
and boolean bytes are C integers); helpers that set a slot (the Event's fields) store
through the slot's descriptor directly (:func:`is_slot_store`); and the varint reader of
:mod:`pipeline.codec.binary_runtime` is a compiled copy (:class:`InC`). Results and errors
are the same: the tests hold both paths to the same outcome on every input they try.

A schema whose decoders call each other in a cycle is never compiled: calls between
compiled functions do not count towards Python's recursion limit, so deeply nested input
could overflow the C stack instead of raising RecursionError.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import MemberDescriptorType, ModuleType
from typing import Any, Final

from pipeline.codec.binary_runtime import Malformed, _read_varint_tail, read_raw_varint

MODULE: Final = "pipeline.codec._native_events"
PYX_FILE: Final = Path(__file__).with_name("_native_events.pyx")
_SIGNATURE: Final = re.compile(r"^def (_dec_\w+)\(data, pos, size\):$", re.MULTILINE)
_TYPED_SIGNATURE: Final = (r"def \1(bytes data, Py_ssize_t pos, Py_ssize_t size):\n"
                           r"    cdef Py_ssize_t _b")
# A long's first two bytes, read inline (binary._Compiler.emit_read_long): in C, the
# value boxed once at the end instead of every byte.
_SHORT_VARINT: Final = re.compile(
    r"^( *)(\w+) = data\[pos\]; pos \+= 1\n"
    r"\1if \2 < 128: \2 = _ZZ\[\2\]\n"
    r"\1elif data\[pos\] < 128:\n"
    r"\1    \2 = \(\2 & 127\) \| \(data\[pos\] << 7\); pos \+= 1; "
    r"\2 = \(\2 >> 1\) \^ -\(\2 & 1\)\n", re.MULTILINE)
_SHORT_VARINT_IN_C: Final = (
    r"\1_b = data[pos]; pos += 1\n"
    r"\1if _b < 128: \2 = _ZZ[_b]\n"
    r"\1elif data[pos] < 128:\n"
    r"\1    _b = (_b & 127) | (data[pos] << 7); pos += 1; \2 = (_b >> 1) ^ -(_b & 1)\n")
# A union's branch index and a boolean's byte: only ever compared, so C integers (a branch
# index beyond one byte comes from the varint reader, which never returns more than 64 bits).
_BRANCH_INDEX: Final = re.compile(
    r"^ *(n\d+) = data\[pos\]; pos \+= 1\n *if \1 > 127: \1, pos = _rraw\(", re.MULTILINE)
_BOOLEAN_BYTE: Final = re.compile(r"^ *(b\d+) = data\[pos\]; pos \+= 1\n *if \1 > 1: raise",
                                  re.MULTILINE)


def _typed(function: str) -> str:
    """One generated function (or the tables after the last) as typed Cython."""
    text = _SHORT_VARINT.sub(_SHORT_VARINT_IN_C, _SIGNATURE.sub(_TYPED_SIGNATURE, function))
    small = ["_b", *_BOOLEAN_BYTE.findall(text)]
    declarations = [f"    cdef Py_ssize_t {', '.join(small)}"]
    indices = _BRANCH_INDEX.findall(text)
    if indices:
        declarations.append(f"    cdef unsigned long long {', '.join(indices)}")
    return text.replace("    cdef Py_ssize_t _b", "\n".join(declarations), 1).rstrip("\n")


_DEFINED: Final = re.compile(r"^(?:def )?(_\w+)\b", re.MULTILINE)
_NAME: Final = re.compile(r"\b_[A-Za-z]\w*\b")
_CALL: Final = re.compile(r"\b(_dec_\w+|_U\d+)\b")
_LOG: Final = logging.getLogger(__name__)


def _free_names(source: str, namespace: Mapping[str, Any]) -> list[str]:
    """The helpers and constants ``source`` reads from its namespace (not its own names)."""
    defined = set(_DEFINED.findall(source))
    return sorted(n for n in set(_NAME.findall(source)) - defined if n in namespace)


def decoder_key(source: str, namespace: Mapping[str, Any]) -> str:
    """What identifies a decoder: its source, the values of the constants it reads and the
    source of the helpers the compiled build has copies of (the other helpers are handed
    over at run time, so they are not part of it)."""
    names = _free_names(source, namespace)
    consts = [f"{n}={namespace[n]!r}" for n in names if n.startswith("_C")]
    copied = [inspect.getsource(f) for name in _in_c(names, namespace)
              for f in _IN_C[name].copies]
    return hashlib.sha256("\n".join([source, *consts, *copied]).encode()).hexdigest()


def _calls_in_a_cycle(source: str) -> bool:
    calls: dict[str, set[str]] = {}
    current = ""
    for line in source.splitlines():
        defined = _DEFINED.match(line)
        if defined is not None:  # a function, or a table of them: what follows it calls
            current = defined.group(1)
            line = line[defined.end():]
        calls.setdefault(current, set()).update(_CALL.findall(line))
    done: set[str] = set()

    def cyclic(name: str, path: frozenset[str]) -> bool:
        if name in path:
            return True
        if name in done:
            return False
        done.add(name)
        return any(cyclic(callee, path | {name}) for callee in calls.get(name, ()))

    return any(cyclic(name, frozenset()) for name in list(calls))


# A helper that is the ``__set__`` of a slot (a member descriptor, e.g. one of the Event's
# fields) becomes a C function storing through the descriptor's own C slot: no call through
# the method wrapper, no argument tuple. The same check as ``__set__`` (the object's type),
# and a TypeError rather than a crash if the descriptor was never handed over.
_SLOT_STORE: Final = '''cdef extern from *:
    """
    static int dsh_store_slot(PyObject *slot, PyObject *obj, PyObject *value) {
        descrsetfunc store = Py_TYPE(slot)->tp_descr_set;
        if (store == NULL) {
            PyErr_SetString(PyExc_TypeError, "slot descriptor not set");
            return -1;
        }
        return store(slot, obj, value);
    }
    """
    int _store_slot "dsh_store_slot" (object slot, object obj, object value) except -1'''


# binary_runtime.read_raw_varint in C (every long of more than two bytes, e.g. each event's
# timestamp, goes through it), with exactly its results and errors: the varint at ``pos`` as
# written (zigzag-encoded) and the position after it; bits past the 64th or an 11th byte are
# Malformed, running past the end an IndexError.
_RAW_VARINT: Final = '''_VarintError = None
cdef tuple _rraw(bytes data, Py_ssize_t pos, str where):
    cdef Py_ssize_t size = len(data)
    cdef const unsigned char* p = data
    cdef unsigned long long z = 0
    cdef unsigned long long b
    cdef int shift = 0
    while True:
        if pos >= size:
            raise IndexError("index out of range")
        b = p[pos]
        pos += 1
        if shift == 63 and b < 0x80 and b > 1:
            raise _VarintError(f"{where}: varint of {63 + int(b).bit_length()} bits, more than "
                               f"the 64 of an Avro long")
        z |= (b & 0x7F) << shift
        if b < 0x80:
            return z, pos
        shift += 7
        if shift > 63:
            raise _VarintError(f"{where}: varint longer than 10 bytes (an Avro long has 64 "
                               f"bits)")'''
@dataclass(frozen=True)
class InC:
    """A helper compiled into the module instead of handed to it: its Cython text, the
    functions it copies (their source is part of the key, so a change to them makes the
    build stale, never different) and what it is handed instead."""

    helper: Callable[..., Any]
    text: str
    copies: tuple[Callable[..., Any], ...]
    hands: Callable[[], dict[str, Any]]


_IN_C: Final[dict[str, InC]] = {
    "_rraw": InC(read_raw_varint, _RAW_VARINT, (read_raw_varint, _read_varint_tail),
                 lambda: {"_VarintError": Malformed}),
}


def _in_c(names: list[str], namespace: Mapping[str, Any]) -> list[str]:
    return [name for name in names if name in _IN_C and namespace[name] is _IN_C[name].helper]


def is_slot_store(helper: Any) -> bool:
    """Whether ``helper`` is the ``__set__`` of a slot (a member descriptor)."""
    return (getattr(helper, "__name__", None) == "__set__"
            and isinstance(getattr(helper, "__self__", None), MemberDescriptorType))


def native_source(source: str, namespace: Mapping[str, Any], root: str) -> str | None:
    """The Cython module of a schema's decoder source (``root`` is its entry point), or
    None for a schema whose decoders are recursive (see the module docstring)."""
    if _calls_in_a_cycle(source) or _SIGNATURE.search(source) is None:
        return None
    names = _free_names(source, namespace)
    stores = [name for name in names if is_slot_store(namespace[name])]
    in_c = _in_c(names, namespace)
    lines = [
        "# cython: language_level=3",
        "# Generated by `python -m pipeline.codec.native_pyx`; do not edit.",
        f"ROOT = {root!r}",
        f"KEY = {decoder_key(source, namespace)!r}",
        "# Set at run time to the helpers and constants the generated Python gets.",
        *(f"{name} = None" for name in names if name not in stores and name not in in_c),
        *(_IN_C[name].text for name in in_c),
        *([_SLOT_STORE] if stores else []),
        *(line for name in stores for line in (
            f"{name}_slot = None",
            f"cdef inline int {name}(object obj, object value) except -1:",
            f"    return _store_slot({name}_slot, obj, value)")),
        *(_typed(function) for function in re.split(r"(?m)^(?=def )", source)),
    ]
    return "\n".join(lines) + "\n"


@cache
def _compiled_module() -> ModuleType | None:
    try:
        module = importlib.import_module(MODULE)
    except ImportError as exc:
        _LOG.info("Avro decoders: generated Python (the compiled decoder is not built: %s)",
                  exc)
        return None
    return module


def compiled_decoder(source: str, namespace: Mapping[str, Any], root: str
                     ) -> Callable[[bytes, int, int], tuple[Any, int]] | None:
    """The compiled build of the decoder ``source`` defines (entry point ``root``), its
    helpers and constants taken from ``namespace``; None unless exactly that was built."""
    module = _compiled_module()
    if module is None or root != module.ROOT:
        return None
    if decoder_key(source, namespace) != module.KEY:
        _log_not_built_from(root)
        return None
    handed: dict[str, Any] = {}  # module attribute -> value
    for name in _free_names(source, namespace):
        helper = namespace[name]
        if hasattr(module, name):
            handed[name] = helper
        elif hasattr(module, f"{name}_slot") and is_slot_store(helper):
            handed[f"{name}_slot"] = helper.__self__
        elif name in _IN_C and helper is _IN_C[name].helper:
            handed.update(_IN_C[name].hands())
        else:
            return None  # compiled in for another helper (a key covers constants only)
    for attribute, value in handed.items():
        setattr(module, attribute, value)
    decoder: Callable[[bytes, int, int], tuple[Any, int]] = getattr(module, root)
    _log_in_use(root)
    return decoder


@cache
def _log_not_built_from(root: str) -> None:
    _LOG.info("Avro decoders: generated Python for a %s the compiled decoder was not built "
              "from (another schema version, or a build older than the code)", root)


@cache
def _log_in_use(root: str) -> None:
    _LOG.info("Avro decoders: the compiled (Cython) %s, generated Python for other schemas",
              root)
