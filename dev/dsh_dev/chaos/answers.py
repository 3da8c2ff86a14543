"""Generated provider answers with realistic timing and provider faults, for the chaos campaign.

:class:`GeneratedAnswers` is a responder of :class:`~.provider_server.LLMTestServer`: each
request gets a streamed answer in DeepSeek's shape (a reasoning run, then either a text answer
or, when the request offers tools and its last message is not a tool result, one tool call),
with ``usage`` (cache hits included) on the last chunk and pauses between chunks.

**Answer ids.** Each answer has an id of its own (``chatcmpl-chaos-<n>``), the ``id`` of its
chunks, so the server's :attr:`~.provider_server.LLMTestServer.reported` usage names it; its
first reasoning delta opens with the id in brackets, so the ``assistant/message`` a driver
logs from the answer names it too (:func:`answer_id_of`): the campaign matches the usage in
the logs with the usage the provider reported, answer by answer.

Faults are drawn per request from the rates in :attr:`GeneratedAnswers.fault_rates` (the
campaign raises them during a provider-fault window and sets them back to 0): ``rate_limit``
(429 with ``Retry-After``), ``server_error`` (500/502/503), ``stall`` (the stream stops for
``stall_s`` seconds, then is torn: longer than the client's idle timeout only if ``stall_s``
is) and ``torn`` (the connection is cut mid-stream). Every fault served is counted in
:attr:`GeneratedAnswers.served`. Draws come from one ``random.Random(seed)``.
"""

from __future__ import annotations

import json
import random
import re
import threading
from collections import Counter
from collections.abc import Mapping
from typing import Any, Final

from dsh_dev.chaos.provider_server import (
    ScriptedResponse,
    SSEEvent,
    chat_chunk,
    error_body,
    tool_call_part,
)

FAULT_KINDS: Final = ("rate_limit", "server_error", "stall", "torn")
ANSWER_ID_PREFIX: Final = "chatcmpl-chaos-"
_ANSWER_TAG: Final = re.compile(r"^\[(chatcmpl-chaos-[0-9]+)\] ")
_WORDS: Final = ("the", "session", "event", "log", "topic", "partition", "turn", "step",
                 "model", "tool", "result", "check", "Kafka", "offset", "replay", "fold")


class GeneratedAnswers:
    """A responder: generated streamed answers, and faults at the configured rates."""

    def __init__(self, seed: int, *, chunk_pause_s: float = 0.015, stall_s: float = 8.0) -> None:
        self._random = random.Random(seed)
        self._lock = threading.Lock()  # rates are set from the campaign's thread
        self.chunk_pause_s = chunk_pause_s
        self.stall_s = stall_s
        self.fault_rates: dict[str, float] = dict.fromkeys(FAULT_KINDS, 0.0)
        self.served: Counter[str] = Counter()
        self._answers = 0

    def set_rates(self, **rates: float) -> None:
        with self._lock:
            for kind, rate in rates.items():
                if kind not in self.fault_rates:
                    raise ValueError(f"unknown provider fault {kind!r}")
                self.fault_rates[kind] = rate

    def __call__(self, body: Any) -> ScriptedResponse:
        with self._lock:
            fault = self._draw_fault()
            answer = self._answer(body if isinstance(body, dict) else {})
            self.served[fault or "answer"] += 1
            return self._with_fault(answer, fault)

    def _draw_fault(self) -> str | None:
        for kind in FAULT_KINDS:
            if self._random.random() < self.fault_rates[kind]:
                return kind
        return None

    def _with_fault(self, answer: ScriptedResponse, fault: str | None) -> ScriptedResponse:
        if fault == "rate_limit":
            return ScriptedResponse(status=429, body=error_body("rate limited", "rate_limit"),
                                    headers={"Retry-After": str(self._random.randint(1, 2))})
        if fault == "server_error":
            status = self._random.choice((500, 502, 503))
            return ScriptedResponse(status=status, body=error_body("upstream failed", "server"))
        if fault in ("stall", "torn"):
            position = self._random.randint(1, max(1, len(answer.events) - 1))
            if fault == "stall":
                answer.hang_after, answer.hang_s = position, self.stall_s
            else:
                answer.cut_after = position
        return answer

    def _answer(self, body: dict[str, Any]) -> ScriptedResponse:
        rng = self._random
        self._answers += 1
        answer = f"{ANSWER_ID_PREFIX}{self._answers}"
        thoughts = [rng.choice(_WORDS) + " " for _ in range(rng.randint(3, 12))]
        thoughts[0] = f"[{answer}] {thoughts[0]}"
        events: list[SSEEvent] = [chat_chunk(reasoning=text, completion_id=answer)
                                  for text in thoughts]
        messages = body.get("messages") or [{}]
        last_role = messages[-1].get("role") if isinstance(messages[-1], dict) else None
        finish = "stop"
        if body.get("tools") and last_role != "tool" and rng.random() < 0.5:
            name = body["tools"][0].get("function", {}).get("name", "echo")
            arguments = json.dumps({"text": " ".join(rng.choices(_WORDS, k=4))})
            call_id = f"call_{rng.getrandbits(48):012x}"
            half = len(arguments) // 2
            events.append(chat_chunk(tool_calls=[tool_call_part(0, call_id=call_id, name=name,
                                                                arguments=arguments[:half])],
                                     completion_id=answer))
            events.append(chat_chunk(tool_calls=[tool_call_part(0, arguments=arguments[half:])],
                                     completion_id=answer))
            finish = "tool_calls"
        else:
            events += [chat_chunk(content=rng.choice(_WORDS) + " ", completion_id=answer)
                       for _ in range(rng.randint(2, 20))]
        prompt = 50 + 20 * len(messages)
        cached = rng.randint(0, prompt // 2)
        events.append(chat_chunk(finish_reason=finish, completion_id=answer))
        events.append(chat_chunk(no_choices=True, completion_id=answer, usage={
            "prompt_tokens": prompt, "completion_tokens": len(events) * 2,
            "total_tokens": prompt + len(events) * 2,
            "prompt_cache_hit_tokens": cached, "prompt_cache_miss_tokens": prompt - cached}))
        return ScriptedResponse(events=events, pause_s=self.chunk_pause_s)


def answer_id_of(message: Mapping[str, Any]) -> str | None:
    """The id of the generated answer an assistant message was made from (its first
    reasoning block opens with it), or None."""
    content = message.get("content")
    for block in content if isinstance(content, list) else ():
        if isinstance(block, Mapping) and block.get("type") == "reasoning":
            found = _ANSWER_TAG.match(str(block.get("text", "")))
            return found.group(1) if found else None
    return None
