"""The public API: the names each public module exports, pinned.

A change to one of these lists is a change of the project's API for downstream services: it
must be made here on purpose (and noted), never by accident. Each listed name must exist.
"""

from __future__ import annotations

import importlib

import pytest

PUBLIC: dict[str, list[str]] = {
    "pipeline.sdk": [
        "ActiveVersion", "At", "CodecError", "Conversation", "Delivery", "DerivedView", "Event",
        "EventRecord", "EventSerde", "EventStream", "OutputChange", "OutputDecoder",
        "OutputSchemaTable", "OutputView", "SeqTracker", "SessionGap", "Settings", "Snapshot",
        "SourcePosition", "SpillRef", "Start", "active_version", "catch_up",
        "derived_conversations", "follow_derived", "follow_fleet", "follow_usage", "open_stream",
        "output_decoder", "partition_for", "process_at_least_once", "read_spill",
        "session_events", "session_records", "spill_refs",
        "PendingApproval", "pending_approvals", "decide_approval",  # issue 32: approvals
    ],
    "pipeline.settings": ["MASK", "Secret", "Settings", "TopicNames"],
    "pipeline.core.events": [
        "APPEND", "CANONICAL_ORDER", "ENVELOPE_KEYS", "SURFACE_TYPES", "Event", "JsonValue",
        "Replace", "SurfaceOp", "dumps_json", "event_from_json", "key_order_of",
        "surface_op_to_json",
    ],
}


@pytest.mark.parametrize("module_name", sorted(PUBLIC))
def test_the_exported_names_are_the_pinned_ones_and_all_exist(module_name: str) -> None:
    module = importlib.import_module(module_name)
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{module_name} has no __all__"
    assert sorted(exported) == sorted(PUBLIC[module_name])
    missing = [name for name in exported if not hasattr(module, name)]
    assert missing == []
