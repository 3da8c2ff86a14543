"""Lossless JSON: the parse-time and in-memory checks agree, and the fast path is exact."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import lossless_json

from pipeline.core.events import dumps_json
from pipeline.core.lossless import (
    _DECODER,
    LosslessJsonError,
    _locate_violation,
    dumps_json_safe,
    find_lossless_violation,
    loads_lossless,
)


@settings(max_examples=300, deadline=None)
@given(lossless_json(12))
def test_lossless_values_round_trip_and_pass_the_check(value: object) -> None:
    assert find_lossless_violation(value) is None
    assert loads_lossless(dumps_json(value)) == value
    assert loads_lossless(dumps_json_safe(value)) == value


NUMBER_TEXT = st.one_of(
    st.from_regex(r"\A-?(0|[1-9][0-9]{0,3})(\.[0-9]{1,3})?([eE][+-]?[0-9]{1,3})?\Z"),
    st.sampled_from(["-0", "-0.0", "-0e5", "-0.000E-2", "1e308", "2e308", "-1e400",
                     "1" * 310 + ".5", "1" * 250 + ".5e60", "-1E-400", "-5e-330", "1e-400",
                     "9" * 19 + "e99", "NaN", "Infinity", "-Infinity"]),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(NUMBER_TEXT, max_size=4), st.text(max_size=5))
def test_fast_path_decides_exactly_like_the_exact_parser(numbers: list[str], text: str) -> None:
    document = "[" + ",".join([*numbers, json.dumps(text)]) + "]"
    try:
        exact = _DECODER.decode(document)
    except LosslessJsonError:
        with pytest.raises(LosslessJsonError):
            loads_lossless(document)
        return
    assert loads_lossless(document) == exact
    assert all(not (isinstance(x, float) and (not math.isfinite(x) or
                                              (x == 0 and math.copysign(1, x) < 0)))
               for x in exact)


@pytest.mark.parametrize(("value", "where"), [
    ({"a": [1, {"b": -0.0}]}, "$.a[1].b: negative zero"),
    ({"a": float("inf")}, "$.a: inf is not a finite number"),
    ({1: "x"}, "$: object key 1 is not a string"),
    ({"s": {1, 2}}, "$.s: set is not a JSON value"),
    ({"t": (1, 2)}, "$.t: tuple is not a JSON value"),
    ({"u": "\ud800"}, "$.u: string holds a lone UTF-16 surrogate"),
])
def test_in_memory_violations_name_the_place(value: object, where: str) -> None:
    problem = find_lossless_violation(value)
    assert problem is not None and problem.startswith(where)


def test_lone_surrogates_are_allowed_only_when_asked_and_written_escaped() -> None:
    value = {"u": "cut \ud83d"}
    assert find_lossless_violation(value, allow_lone_surrogates=True) is None
    text = dumps_json_safe(value)
    assert text.isascii() and loads_lossless(text) == value
    assert dumps_json_safe({"e": "é"}) == '{"e":"é"}'


def test_deep_nesting_does_not_overflow_the_checker() -> None:
    value: object = "leaf"
    for _ in range(100_000):
        value = [value]
    assert find_lossless_violation(value) is None


BAD_LEAVES = st.sampled_from([-0.0, float("nan"), float("inf"), float("-inf"), (1,), {2},
                              b"x", "\udfff", "ok \ud83d", object()])
ANY_LEAF = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=4),
                     BAD_LEAVES)
MIXED_JSON = st.recursive(
    ANY_LEAF,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=3), st.integers(), st.none()), inner,
                        max_size=4)),
    max_leaves=12)


@settings(max_examples=500, deadline=None)
@given(MIXED_JSON, st.booleans())
def test_the_fast_walk_decides_like_the_walk_that_names_the_place(
        value: object, allow_lone_surrogates: bool) -> None:
    located = _locate_violation(value, allow_lone_surrogates)
    assert (find_lossless_violation(value, allow_lone_surrogates=allow_lone_surrogates)
            is None) == (located is None)
