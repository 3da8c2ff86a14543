"""dsh's spill policy on tool results, without a broker: preview shape, cap, notice, fallbacks.

The store here keeps texts in a dict (the Kafka store is tested on the real broker in
test_large_content_kafka.py); what is checked is what the model sees and what the log keeps.
"""

from __future__ import annotations

import hashlib

import pytest

from pipeline.core.turn_effects import ToolOutcome
from pipeline.services.driver.spill import (
    RESULT_TOO_LARGE,
    SpilledText,
    SpillPolicy,
    head_tail_preview,
    replacement_text,
    spill_notice,
)
from pipeline.services.driver.tools import ECHO, ToolRegistry

INLINE = 2_000
RECORD = 1024 * 1024


class DictStore:
    """Keeps every saved text by its hash."""

    def __init__(self, fail: bool = False) -> None:
        self.texts: dict[str, str] = {}
        self.fail = fail

    async def save(self, text: str) -> SpilledText:
        if self.fail:
            raise OSError("disk full")
        sha = hashlib.sha256(text.encode()).hexdigest()
        self.texts[sha] = text
        return SpilledText(f"mem:{sha}", {"sha256": sha})


def numbered_lines(total_bytes: int) -> str:
    lines = "".join(f"line {n:07d} of a long tool output\n" for n in range(total_bytes // 30 + 1))
    return lines[:total_bytes]


async def test_a_result_within_the_cap_is_left_alone() -> None:
    store = DictStore()
    policy = SpillPolicy(store.save, inline_bytes=INLINE, max_record_bytes=RECORD)
    outcome = ToolOutcome.text("x" * INLINE)
    assert await policy.bound("echo", outcome) is outcome
    assert store.texts == {}


async def test_an_oversized_text_becomes_head_tail_preview_and_notice_within_the_cap() -> None:
    store = DictStore()
    policy = SpillPolicy(store.save, inline_bytes=INLINE, max_record_bytes=RECORD)
    original = numbered_lines(100_000)
    bounded = await policy.bound("bash", ToolOutcome(
        ({"type": "text", "text": original[:40_000]}, {"type": "text", "text": original[40_000:]}),
        meta={"exitCode": 0}))
    [block] = bounded.content
    assert isinstance(block, dict)
    text = block["text"]
    assert len(text.encode()) <= INLINE
    preview, notice = text.rsplit("\n\n", 1)
    sha = hashlib.sha256(original.encode()).hexdigest()
    assert store.texts == {sha: original}   # the whole text, both blocks joined
    head_len = (len(preview) + 1) // 2
    assert original.startswith(preview[:head_len]) and original.endswith(preview[head_len:])
    omitted = len(original) - len(preview)
    assert notice == spill_notice(omitted, f"mem:{sha}")
    assert notice.startswith(f"(Omitted {omitted} bytes. Full formatted result stored at: "
                             f"mem:{sha}. ")
    assert bounded.meta == {"exitCode": 0, "spill": {"sha256": sha}}
    assert not bounded.is_error and policy.spilled == 1


def test_preview_cuts_on_character_boundaries_and_counts_what_it_left_out() -> None:
    text = "é" * 1000 + "漢" * 1000   # 2-byte, then 3-byte characters
    preview = head_tail_preview(text, 101)  # 51 head bytes, 50 tail bytes: both mid-character
    assert preview.text == "é" * 25 + "漢" * 16
    assert preview.omitted_bytes == len(text.encode()) - len(preview.text.encode())
    assert head_tail_preview("short", 100).text == "short"
    assert head_tail_preview("short", 100).omitted_bytes == 0


def test_when_even_the_notice_does_not_fit_there_is_no_replacement() -> None:
    assert replacement_text("y" * 500, 500, "mem:" + "0" * 64, 60) is None
    just_the_notice = len(spill_notice(5000, "mem:abc").encode()) + 2
    only_notice = replacement_text("y" * 5000, 5000, "mem:abc", just_the_notice)
    assert only_notice == spill_notice(5000, "mem:abc")


async def test_a_failed_spill_keeps_the_original_when_the_log_can_hold_it() -> None:
    policy = SpillPolicy(DictStore(fail=True).save, inline_bytes=INLINE, max_record_bytes=RECORD)
    outcome = ToolOutcome.text("z" * 10_000)
    assert await policy.bound("echo", outcome) is outcome


async def test_a_result_the_log_cannot_hold_and_the_store_cannot_take_is_an_error() -> None:
    policy = SpillPolicy(DictStore(fail=True).save, inline_bytes=INLINE, max_record_bytes=RECORD)
    bounded = await policy.bound("echo", ToolOutcome.text("z" * (2 * RECORD)))
    assert bounded.is_error
    assert bounded.error == {"name": RESULT_TOO_LARGE[0], "code": RESULT_TOO_LARGE[1]}
    assert "could not be spilled" in str(bounded.content[0])
    assert policy.refused == 1


async def test_non_text_results_are_not_spilled_but_still_bounded_by_the_record() -> None:
    store = DictStore()
    policy = SpillPolicy(store.save, inline_bytes=INLINE, max_record_bytes=RECORD)
    image = {"type": "image", "attachment": {"data": "A" * 10_000}}
    small = ToolOutcome(({"type": "text", "text": "see"}, image))
    assert await policy.bound("shot", small) is small
    huge = ToolOutcome(({"type": "image", "attachment": {"data": "A" * (2 * RECORD)}},))
    assert (await policy.bound("shot", huge)).error == {"name": RESULT_TOO_LARGE[0],
                                                         "code": RESULT_TOO_LARGE[1]}
    assert store.texts == {}


async def test_the_registry_hands_every_outcome_to_its_post_execute() -> None:
    store = DictStore()
    policy = SpillPolicy(store.save, inline_bytes=INLINE, max_record_bytes=RECORD)
    registry = ToolRegistry([ECHO]).with_post_execute(policy.bound)
    long = await registry.run("echo", '{"text": "%s"}' % ("w" * 5000))
    assert "(Omitted " in str(long.content[0]) and len(store.texts) == 1
    assert (await registry.run("echo", '{"text": "hi"}')).content == (
        {"type": "text", "text": "hi"},)


@pytest.mark.parametrize("budget", [0, 1, 2, 3, 7])
def test_tiny_budgets_never_exceed_themselves(budget: int) -> None:
    preview = head_tail_preview("ab漢cd" * 10, budget)
    assert len(preview.text.encode()) <= budget
