"""Helpers of the processors' broker tests: publish sessions, run workers, read their HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.records import OutRecord
from pipeline.codec.avro import EventSerde
from pipeline.codec.outputs import OutputDecoder
from pipeline.codec.records import event_headers, record_key
from pipeline.core.errors import CodecError
from pipeline.core.events import Event
from pipeline.services.processors.options import ProcessorsOptions
from pipeline.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
WORKER_READY_S = 90.0
_OUTPUTS = OutputDecoder()  # values of the derived output topics (Avro)


def event_records(settings: Settings, session_id: str, events: Iterable[Event],
                  serde: EventSerde | None = None) -> list[OutRecord]:
    serde = serde or EventSerde()
    topic = settings.topics.session_events
    return [OutRecord(topic, record_key(session_id), serde.encode(session_id, e),
                      tuple(event_headers(e))) for e in events]


def fresh_settings(bootstrap: str, partitions: int = 3) -> Settings:
    """Settings on topics and a group of their own (a unique prefix), replication 1."""
    prefix = f"t{uuid.uuid4().hex[:10]}."
    return Settings.from_env({}, bootstrap_servers=bootstrap, topic_prefix=prefix,
                             partitions=partitions, replication_factor=1,
                             group_id_prefix=f"{prefix}g-")


def worker_env(settings: Settings, state_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "DSH_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
        "DSH_TOPIC_PREFIX": settings.topic_prefix,
        "DSH_PARTITIONS": str(settings.partitions),
        "DSH_REPLICATION_FACTOR": str(settings.replication_factor),
        "DSH_GROUP_ID_PREFIX": settings.group_id_prefix,
        "DSH_STATE_DIR": str(state_dir),
        "DSH_MAX_RECORD_BYTES": str(settings.max_record_bytes),
    })
    return env


class Worker:
    """One ``dsh-pipeline processors`` subprocess and its HTTP port."""

    def __init__(self, settings: Settings, port: int, state_dir: Path,
                 extra: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
        self.port = port
        self.log_path = state_dir / f"worker-{port}.log"
        state_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        argv = [sys.executable, "-m", "pipeline.cli.main", "processors", "--web-port",
                str(port), "--loglevel", "INFO", "--session-timeout", "15", *extra]
        self.proc = subprocess.Popen(argv, cwd=ROOT,
                                     env={**worker_env(settings, state_dir), **(env or {})},
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path: str) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(self.url(path), timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def wait_for(self, what: str, check: Callable[[], bool], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited ({self.proc.returncode}) waiting for "
                                     f"{what}; log:\n{self.tail()}")
            try:
                if check():
                    return
            except (OSError, urllib.error.URLError, ValueError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; log:\n{self.tail()}")

    def wait_ready(self) -> None:
        """Up, assigned and done recovering."""
        def ready() -> bool:
            status, body = self.get("/health")
            return status == 200 and not body["recovery"]["in_recovery"] and bool(
                body["partitions"])
        self.wait_for("worker ready", ready, WORKER_READY_S)

    def tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


class SessionBuilder:
    """Builds a valid, realistic session log: turns, steps, chunks, tools, usage, replaces."""

    def __init__(self, rng: Any, provider: str, model: str, now_ms: int,
                 max_chunks: int = 12) -> None:
        self.rng = rng
        self.max_chunks = max_chunks
        self.provider, self.model = provider, model
        self.time = now_ms
        self.events: list[Event] = []
        self.surface: list[int] = []   # live surface seqs, for replaces

    def add(self, type_: str, data: Any, op: Any = None, sources: Any = None) -> int:
        seq = len(self.events)
        self.time += self.rng.randint(0, 30)
        self.events.append(Event(type_, seq, self.time, data, op, sources))
        if op == "append":
            self.surface.append(seq)
        return seq

    def user(self, text: str) -> None:
        from pipeline.core.events import Replace
        message = {"id": f"u{len(self.events)}", "role": "user",
                   "content": [{"type": "text", "text": text}], "source": {"kind": "user"}}
        users = [i for i, seq in enumerate(self.surface) if self.events[seq].type == "user/message"]
        if users and self.rng.random() < 0.3:
            # Replace a run of surface nodes starting at a user message (e.g. rewritten
            # instructions shadowing what followed them).
            first = self.rng.choice(users)
            last = self.rng.randint(first, min(len(self.surface) - 1, first + 2))
            run = self.surface[first:last + 1]
            seq = self.add("user/message", message, Replace(run[0], run[-1]), tuple(run))
            self.surface[first:last + 1] = [seq]
        else:
            self.add("user/message", message, "append")

    def step(self, turn: int, step: int, with_tool: bool) -> None:
        self.add("step/start", {"turn": turn, "step": step})
        self.user(f"input {turn}.{step}")
        self.add("request/header", {"header": {"config": {"provider": self.provider,
                                                          "model": self.model}},
                                    "reason": "initial" if step == 1 else "resume"})
        chunk_seqs = [self.add("assistant/chunk", {"turn": turn, "step": step, "chunk": {
            "type": "text-delta", "index": 0, "text": f"w{i} "}})
            for i in range(self.rng.randint(0, self.max_chunks))]
        content: list[Any] = [{"type": "text", "text": "answer"}] if self.rng.random() < 0.9 else []
        call_id = f"call_{turn}_{step}"
        if with_tool:
            content.append({"type": "tool-call", "id": call_id, "name": "echo",
                            "arguments": "{}"})
        usage = {"inputTokens": self.rng.randint(1, 5000), "outputTokens": self.rng.randint(
            1, 500), "cacheReadTokens": self.rng.randint(0, 3000),
            "cacheWriteTokens": self.rng.randint(0, 100), "reasoningTokens": 0}
        source = {"kind": "model", "provider": self.provider, "model": self.model}
        self.add("assistant/message", {"turn": turn, "step": step, "usage": usage, "message": {
            "id": f"m{len(self.events)}", "role": "assistant", "content": content,
            "source": source}}, "append", tuple(chunk_seqs))
        if with_tool:
            call = self.add("tool/call", {"turn": turn, "step": step, "callId": call_id,
                                          "name": "echo", "arguments": "{}"})
            self.add("tool/result", {"turn": turn, "step": step, "message": {
                "id": f"r{call}", "role": "user", "source": {"kind": "tool", "callId": call_id},
                "content": [{"type": "tool-result", "toolCallId": call_id,
                             "content": [{"type": "text", "text": "ok"}]}]}},
                "append", (call,))
        self.add("step/end", {"turn": turn, "step": step})

    def turn(self, turn: int) -> None:
        self.add("turn/start", {"turn": turn})
        steps = self.rng.randint(1, 3)
        for step in range(1, steps + 1):
            self.step(turn, step, with_tool=step < steps)
        reason = {"kind": "completed"} if self.rng.random() < 0.8 else {
            "kind": "error", "error": {"message": "boom", "code": "SERVER"}}
        self.add("turn/end", {"turn": turn, "reason": reason})


def generated_sessions(seed: int, count: int, provider: str, models: Sequence[str],
                       now_ms: int, max_chunks: int = 12,
                       tenants: Sequence[str] = ()) -> dict[str, list[Event]]:
    """``count`` sessions of 1-4 turns each, spread over ``models`` (and over ``tenants``
    when given: a session of a tenant other than ``""`` starts with its tenant event, as
    the driver writes it, :mod:`pipeline.core.tenants`)."""
    import random

    from pipeline.core.tenants import TENANT_TYPE, tenant_event_data
    rng = random.Random(seed)
    sessions: dict[str, list[Event]] = {}
    for index in range(count):
        builder = SessionBuilder(rng, provider, models[index % len(models)], now_ms,
                                 max_chunks)
        tenant = tenants[index % len(tenants)] if tenants else ""
        if tenant:
            builder.events.append(Event(TENANT_TYPE, 0, now_ms,
                                        tenant_event_data(tenant, f"cmd-{index}"),
                                        ignorable=True))
        for turn in range(1, rng.randint(1, 4) + 1):
            builder.turn(turn)
        sessions[f"{provider}-s{index}"] = builder.events
    return sessions


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def read_topic(settings: Settings, topic: str) -> list[tuple[str, Any, dict[str, bytes]]]:
    """Every record now in ``topic`` as (key, JSON value or raw bytes or None, headers)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap_servers,
                                enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in
                 sorted(consumer.partitions_for_topic(topic) or
                        await _partitions(consumer, topic))]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        ends = await consumer.end_offsets(parts)
        out: list[tuple[str, Any, dict[str, bytes]]] = []
        while [tp for tp in parts if await consumer.position(tp) < ends[tp]]:
            batch = await consumer.getmany(*parts, timeout_ms=500)
            for records in batch.values():
                out += [(r.key.decode(), _value(r.value), dict(r.headers)) for r in records]
        return out
    finally:
        await consumer.stop()


async def _partitions(consumer: Any, topic: str) -> set[int]:
    await consumer._client.force_metadata_update()
    return set(consumer.partitions_for_topic(topic) or ())


def _value(raw: bytes | None) -> Any:
    """A derived output record decoded (Avro), else JSON, else the raw bytes (e.g. a dead
    letter's original Avro session event)."""
    if raw is None:
        return None
    try:
        return _OUTPUTS.decode(raw)
    except CodecError:
        pass
    try:
        return json.loads(raw)
    except ValueError:
        return raw


async def committed_and_ends(settings: Settings) -> tuple[dict[int, int], dict[int, int]]:
    """The processors group's committed offset and the end offset, per session partition."""
    group = ProcessorsOptions().app_id(settings)
    consumer = AIOKafkaConsumer(**client_options(settings), group_id=group,
                                enable_auto_commit=False)
    await consumer.start()
    try:
        parts = [TopicPartition(settings.topics.session_events, p)
                 for p in range(settings.partitions)]
        ends = await consumer.end_offsets(parts)
        committed = {tp.partition: (await consumer.committed(tp)) or 0 for tp in parts}
        return committed, {tp.partition: ends[tp] for tp in parts}
    finally:
        await consumer.stop()
