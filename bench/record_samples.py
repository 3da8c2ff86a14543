"""Re-record the sample sessions of ``samples/sessions/`` from the project's own driver.

Each sample is a real run of :class:`pipeline.services.driver.memory.Driver` (the in-memory
router over the same :class:`SessionRunner` the Kafka driver uses) with the scripted
provider, with a fixed clock, counter ids and no jitter, so re-recording writes the same
bytes. The samples cover text turns, tool calls, a cancel, a steer, a retry and a
compaction (dsh's compaction plugin runs between turns; the driver has none, so the sample
logs its three events between two driver turns, as dsh does). Every file is checked with
the strict rules before it is written.

Run from the checkout: ``.venv/bin/python bench/record_samples.py [--out samples/sessions]``.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeline.adapters.llm.scripted import (
    Script,
    ScriptedError,
    ScriptedProvider,
    ScriptedReply,
    echo_script,
    tool_loop_script,
)
from pipeline.codec.sessionfile import write_session_file
from pipeline.core.events import Event, JsonValue, Replace
from pipeline.core.inbox import Cancel, FollowUp, InboxCommand, Steer
from pipeline.core.log import SessionLog
from pipeline.core.model import ModelRequest, RetryPolicy
from pipeline.core.turn_effects import SessionConfig
from pipeline.services.driver.memory import Driver, MemorySink
from pipeline.services.driver.tools import builtin_registry

OUT = Path(__file__).resolve().parents[1] / "samples" / "sessions"
EPOCH_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z: fixed, so a re-recording is identical
CONFIG = SessionConfig(provider="scripted", model="scripted-1")


class Recorder:
    """One session driven by the in-memory driver, with deterministic ids and times."""

    def __init__(self, session_id: str, script: Script, *,
                 on_event: Callable[[Recorder, Event], None] | None = None) -> None:
        self.session_id = session_id
        self._time = EPOCH_MS
        self._ids = 0
        self._on_event = on_event
        self.sink = _WatchingSink(self)
        provider = ScriptedProvider(script)
        self.driver = Driver(provider_factory=lambda _p, _m: provider,
                             tools=builtin_registry(), sink=self.sink, clock=self._clock,
                             config=CONFIG, new_id=self._new_id, jitter=lambda: 0.0,
                             retry=RetryPolicy(max_attempts=3, base_ms=20, max_ms=100))
        self.log = SessionLog(session_id)
        self.driver.runner(session_id, self.log)

    def _clock(self) -> int:
        self._time += 7
        return self._time

    def _new_id(self) -> str:
        self._ids += 1
        return f"{self.session_id}-{self._ids:04d}"

    def text(self, kind: type[FollowUp] | type[Steer], text: str) -> InboxCommand:
        return kind(self.session_id, self._new_id(), ({"type": "text", "text": text},))

    async def turn(self, text: str) -> None:
        self.driver.submit(self.text(FollowUp, text))
        await self.driver.drain()

    def seen(self, event: Event) -> None:
        if self._on_event is not None:
            self._on_event(self, event)

    def compact(self, summary: str) -> None:
        """Log a compaction as dsh's plugin does between turns: the summary replaces the
        oldest live surface nodes but the last two."""
        nodes = self.log.surface()
        first, last = nodes[0].seq, nodes[-3].seq
        compaction_id = self._new_id()
        self._append("compaction/start", {"compactionId": compaction_id,
                                          "nodes": len(nodes) - 2})
        message: dict[str, JsonValue] = {
            "role": "user", "id": self._new_id(), "source": {"kind": "plugin"},
            "content": [{"type": "text", "text": summary}]}
        shadowed = tuple(node.seq for node in nodes[:-2])
        self._append("user/message", message, Replace(first, last), shadowed)
        self._append("compaction/end", {"compactionId": compaction_id})

    def _append(self, type_: str, data: JsonValue, op: Any = None,
                sources: tuple[int, ...] | None = None) -> None:
        self.log.append(Event(type_, self.log.next_seq, self._clock(), data, op, sources))

    def write(self, out: Path) -> Path:
        path = out / f"{self.session_id}.jsonl"
        SessionLog.from_events(self.session_id, self.log.events, mode="strict")
        write_session_file(path, self.log.events,
                           header={"type": "session", "version": 0, "id": self.session_id},
                           packed=True)
        return path


class _WatchingSink(MemorySink):
    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self._recorder = recorder

    async def emit(self, session_id: str, events: Sequence[Event]) -> None:
        await super().emit(session_id, events)
        for event in events:
            self._recorder.seen(event)


def _slow(script: Script, chunk_delay_ms: int) -> Script:
    def slow(request: ModelRequest, attempt: int) -> ScriptedReply:
        reply = script(request, attempt)
        return ScriptedReply(reply.text, reply.reasoning, reply.tool_calls, reply.finish,
                             reply.usage, reply.error, chunk_delay_ms=chunk_delay_ms)
    return slow


def _failing_once(script: Script) -> Script:
    """The first attempt of every request fails mid-stream with a retriable SERVER error."""
    def failing(request: ModelRequest, attempt: int) -> ScriptedReply:
        reply = script(request, attempt)
        if attempt > 1:
            return reply
        error = ScriptedError("SERVER", "upstream overloaded", status=503, after_chunks=2)
        return ScriptedReply(reply.text, reply.reasoning, reply.tool_calls, error=error)
    return failing


async def text_turns() -> Recorder:
    recorder = Recorder("text-turns", echo_script)
    await recorder.turn("Hello! What can you do?")
    await recorder.turn("Say it again, shorter.")
    return recorder


async def tool_calls() -> Recorder:
    recorder = Recorder("tool-calls", tool_loop_script("echo", '{"text": "hello from the tool"}'))
    await recorder.turn("Call the echo tool, then tell me what it said.")
    await recorder.turn("Once more, please.")
    return recorder


async def cancel() -> Recorder:
    def cancel_on_text(recorder: Recorder, event: Event) -> None:
        chunk = event.data.get("chunk") if isinstance(event.data, dict) else None
        if isinstance(chunk, dict) and chunk.get("type") == "text-delta" and not fired:
            fired.append(True)
            asyncio.get_running_loop().call_soon(
                recorder.driver.submit, Cancel(recorder.session_id, recorder._new_id()))
    fired: list[bool] = []
    recorder = Recorder("cancel", _slow(echo_script, 30), on_event=cancel_on_text)
    await recorder.turn("Write a long story about a lighthouse.")
    await recorder.turn("Never mind. Just say hi.")
    return recorder


async def steer() -> Recorder:
    def steer_on_tool_call(recorder: Recorder, event: Event) -> None:
        if event.type == "tool/call" and not fired:
            fired.append(True)
            command = recorder.text(Steer, "Keep the answer to one sentence.")
            asyncio.get_running_loop().call_soon(recorder.driver.submit, command)
    fired: list[bool] = []
    recorder = Recorder("steer", tool_loop_script("echo", '{"text": "steered"}'),
                        on_event=steer_on_tool_call)
    await recorder.turn("Use the echo tool and explain what it returns.")
    return recorder


async def retry() -> Recorder:
    recorder = Recorder("retry", _failing_once(echo_script))
    await recorder.turn("This request fails once upstream, then succeeds.")
    return recorder


async def compaction() -> Recorder:
    recorder = Recorder("compaction", echo_script)
    for text in ("First question about the build.", "Second question about the tests.",
                 "Third question about the deploy."):
        await recorder.turn(text)
    recorder.compact("Summary of the earlier conversation: the user asked about the build, "
                     "the tests and the deploy; each was answered.")
    await recorder.turn("What did we talk about?")
    return recorder


SCENARIOS = (text_turns, tool_calls, cancel, steer, retry, compaction)


async def record(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    return [(await scenario()).write(out) for scenario in SCENARIOS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"folder to write (default {OUT})")
    args = parser.parse_args()
    for path in asyncio.run(record(args.out)):
        print(path)


if __name__ == "__main__":
    main()
