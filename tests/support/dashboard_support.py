"""Helpers of the dashboard tests: settings, a live session written step by step, publishing,
plain HTTP reads (urllib against the real server) and a Prometheus text check."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

from processors_support import event_records

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.core.events import Event
from pipeline.settings import Secret, Settings


def dashboard_settings(kafka_bootstrap: str, topic_prefix: str, token: str = "") -> Settings:
    return Settings.from_env({}, bootstrap_servers=kafka_bootstrap, topic_prefix=topic_prefix,
                             partitions=3, replication_factor=1,
                             group_id_prefix=f"{topic_prefix}g-", dashboard_token=Secret(token))


async def prepare_topics(settings: Settings) -> None:
    await ensure_topics(settings)


async def publish(settings: Settings, session_id: str, events: Iterable[Event]) -> None:
    await send_records(settings, event_records(settings, session_id, list(events)))


class LiveSession:
    """A session log written the way the driver writes it, chunk by chunk, at wall time."""

    def __init__(self, session_id: str, provider: str = "deepseek", model: str = "chat-1"
                 ) -> None:
        self.session_id = session_id
        self.provider, self.model = provider, model
        self.events: list[Event] = []
        self.sent = 0
        self.turn = self.step = 0

    def add(self, type_: str, data: Any, op: Any = None, sources: Any = None) -> int:
        seq = len(self.events)
        self.events.append(Event(type_, seq, int(time.time() * 1000), data, op, sources))
        return seq

    def take(self) -> list[Event]:
        """The events added since the last take (what to publish now)."""
        new, self.sent = self.events[self.sent:], len(self.events)
        return new

    def start_turn(self, text: str) -> None:
        self.turn += 1
        self.step = 0
        self.add("turn/start", {"turn": self.turn})
        self.start_step()
        self.add("user/message", {"id": f"u{len(self.events)}", "role": "user", "content": [
            {"type": "text", "text": text}], "source": {"kind": "user"}}, "append")
        self.add("request/header", {"header": {"config": {"provider": self.provider,
                                                          "model": self.model}},
                                    "reason": "initial"})

    def start_step(self) -> None:
        self.step += 1
        self.add("step/start", {"turn": self.turn, "step": self.step})

    def chunk(self, chunk: dict[str, Any]) -> int:
        return self.add("assistant/chunk", {"turn": self.turn, "step": self.step,
                                            "chunk": chunk})

    def answer(self, parts: list[str]) -> list[int]:
        seqs = [self.chunk({"type": "block-start", "index": 0, "blockType": "text"})]
        seqs += [self.chunk({"type": "text-delta", "index": 0, "text": p}) for p in parts]
        return seqs

    def finish(self, seqs: list[int], text: str, usage: dict[str, int]) -> None:
        block = {"type": "text", "text": text}
        seqs.append(self.chunk({"type": "block-end", "index": 0, "block": block}))
        seqs.append(self.chunk({"type": "usage", "usage": usage}))
        seqs.append(self.chunk({"type": "finish", "reason": {"kind": "stop"}}))
        source = {"kind": "model", "provider": self.provider, "model": self.model}
        self.add("assistant/message", {"turn": self.turn, "step": self.step, "usage": usage,
                                       "message": {"id": f"m{len(self.events)}",
                                                   "role": "assistant", "content": [block],
                                                   "source": source}}, "append", tuple(seqs))
        self.add("step/end", {"turn": self.turn, "step": self.step})

    def end_turn(self, kind: str = "completed") -> None:
        self.add("turn/end", {"turn": self.turn, "reason": {"kind": kind}})


def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return 0, {}, ""  # not listening (yet)


async def aget(url: str, headers: dict[str, str] | None = None
               ) -> tuple[int, dict[str, str], str]:
    return await asyncio.to_thread(http_get, url, headers)


def prometheus_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics body, parsed by the official Prometheus text parser."""
    from prometheus_client.parser import text_string_to_metric_families
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def eventually(check: Any, timeout_s: float = 30.0, what: str = "condition") -> Any:
    """Poll an async check until it returns a truthy value (the test's own wait)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


SseMessages = list[tuple[str, Any]]


async def read_sse(url: str, headers: dict[str, str], wanted: int | None = None,
                   until: Callable[[SseMessages], bool] | None = None) -> SseMessages:
    """SSE messages of a stream (read over a raw socket): the first ``wanted``, or up to the
    first list ``until`` accepts."""
    host, _, rest = url.removeprefix("http://").partition("/")
    name, port = host.split(":")
    reader, writer = await asyncio.open_connection(name, int(port))
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(f"GET /{rest} HTTP/1.1\r\nHost: {host}\r\n{head}\r\n".encode())
    await writer.drain()
    messages: SseMessages = []
    event = ""
    try:
        while not (len(messages) == wanted or (until is not None and until(messages))):
            line = (await asyncio.wait_for(reader.readline(), 20)).decode().rstrip("\r\n")
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                messages.append((event, json.loads(line[6:])))
    finally:
        writer.close()
    return messages
