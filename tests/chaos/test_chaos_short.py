"""The short chaos campaign: the whole fleet for about 2 minutes, every fault kind, every invariant.

Runs ``dsh-pipeline chaos --minutes 2`` as a subprocess (its own 3-node cluster behind
Toxiproxy; the shared broker is not used) and reads the report it writes. Selected with
``-m cluster``; skipped when the Toxiproxy binary is missing (``make toxiproxy``). The full
campaign is the command itself (``make chaos``).

The provider and unit-level parts of the campaign are checked here too, without a cluster:
the generated answers stream through the real provider adapter, and each provider fault reaches
the adapter as the error the driver's retry policy expects.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dsh_dev.chaos.answers import FAULT_KINDS, GeneratedAnswers, answer_id_of
from dsh_dev.chaos.faults import GARBAGE, TOXICS, FaultPlan
from dsh_dev.chaos.provider_server import LLMTestServer
from dsh_dev.chaos.toxiproxy import toxiproxy_binary
from pipeline.adapters.llm.http_provider import OpenAICompatibleProvider
from pipeline.core.errors import ProviderError
from pipeline.core.model import ModelRequest, StreamAccumulator

ROOT = Path(__file__).resolve().parents[2]


def _request(tools: bool) -> ModelRequest:
    return ModelRequest(
        provider="openai", model="chaos-model-a",
        messages=({"id": "u1", "role": "user", "content": [{"type": "text", "text": "hi"}],
                   "source": {"kind": "user"}},),
        tools=({"name": "echo", "description": "echo", "parameters": {"type": "object"}},)
        if tools else None)


async def _stream(provider: OpenAICompatibleProvider, request: ModelRequest
                  ) -> list[dict[str, Any]]:
    return [chunk async for chunk in provider.stream(request)]


async def test_generated_answers_stream_through_the_real_adapter() -> None:
    answers = GeneratedAnswers(seed=3, chunk_pause_s=0.0)
    server = LLMTestServer(answers)
    base_url = await server.start()
    provider = OpenAICompatibleProvider(base_url, trust_env=False)
    try:
        kinds = set()
        for _ in range(12):
            chunks = await _stream(provider, _request(tools=True))
            finish = [c for c in chunks if c.get("type") == "finish"]
            assert finish, chunks
            kinds.add(repr(finish[-1]["reason"]))
        assert len(kinds) == 2  # both a text answer and a tool call came (seeded)
        assert answers.served["answer"] == 12
    finally:
        await server.stop()


@pytest.mark.parametrize("kind", FAULT_KINDS)
async def test_each_provider_fault_reaches_the_adapter_as_an_error(kind: str) -> None:
    answers = GeneratedAnswers(seed=5, chunk_pause_s=0.0, stall_s=0.2)
    answers.set_rates(**{kind: 1.0})
    server = LLMTestServer(answers)
    base_url = await server.start()
    provider = OpenAICompatibleProvider(base_url, trust_env=False)
    try:
        with pytest.raises(ProviderError) as caught:
            await _stream(provider, _request(tools=False))
        expected = {"rate_limit": "RATE_LIMIT", "server_error": ("SERVER", "OVERLOADED")}
        if kind in expected:
            assert caught.value.code in expected[kind]
        if kind == "rate_limit":
            assert caught.value.retry_after_ms in (1000, 2000)
        assert answers.served[kind] == 1
    finally:
        await server.stop()


async def test_the_server_keeps_the_usage_it_sent_and_a_torn_answer_sends_none() -> None:
    """Each answer's chunks carry its id; the server's ``reported`` names it, and the answer's
    reasoning opens with it (what the chaos ledger check matches the logs against)."""
    answers = GeneratedAnswers(seed=5, chunk_pause_s=0.0)
    server = LLMTestServer(answers, keep_requests=False)
    provider = OpenAICompatibleProvider(await server.start(), trust_env=False)
    request = _request(tools=False)
    try:
        answers.set_rates(torn=1.0)
        with pytest.raises(ProviderError):
            _ = [chunk async for chunk in provider.stream(request)]
        answers.set_rates(torn=0.0)
        chunks = [chunk async for chunk in provider.stream(request)]
    finally:
        await provider.aclose()
        await server.stop()
    assert answers.served == {"torn": 1, "answer": 1}
    assert [r.completion_id for r in server.reported] == ["chatcmpl-chaos-2"]
    usage = next(c["usage"] for c in chunks if c["type"] == "usage")
    assert usage["inputTokens"] + usage["cacheReadTokens"] == \
        server.reported[0].usage["prompt_tokens"]
    message = StreamAccumulator()
    for chunk in chunks:
        message.add(chunk)
    assert answer_id_of({"content": message.content()}) == "chatcmpl-chaos-2"


def test_every_fault_kind_is_planned_at_least_once_in_the_short_run() -> None:
    plan = FaultPlan.for_duration(100)
    assert plan.service_kills >= 4 and plan.broker_kills >= 1 and plan.stops >= 1
    assert plan.processors_stops >= 1
    assert plan.toxics >= len(TOXICS)
    assert plan.provider_windows >= len(FAULT_KINDS)
    assert plan.garbage >= 2 * len(GARBAGE)  # each kind into the inbox and the session topic
    full = FaultPlan.for_duration(15 * 60 * 0.85)
    assert full.service_kills >= 100 and full.broker_kills >= 10


INBOX_ONCE = "every inbox command entered its session exactly once"


@dataclass(frozen=True)
class Campaign:
    returncode: int
    stderr: str
    report: str

    def invariants(self) -> dict[str, str]:
        """Each invariant row of the report's table: its name -> its result."""
        section = self.report.split("## Invariants", 1)[-1].split("\n## ", 1)[0]
        rows = re.findall(r"^\| ([^|]+?) \| ([^|]+?) \|", section, re.M)
        return {name: result for name, result in rows if name not in ("invariant", "---")}


@pytest.fixture(scope="module")
def campaign(tmp_path_factory: pytest.TempPathFactory) -> Campaign:
    binary = Path(os.environ.get("DSH_TOXIPROXY", str(toxiproxy_binary())))
    if not binary.is_file():
        # `make test` (and so CI) installs it: there, a missing binary is a broken install.
        if os.environ.get("CI"):
            pytest.fail(f"no Toxiproxy at {binary}: `make test` should have installed it")
        pytest.skip(f"no Toxiproxy at {binary}: run `make toxiproxy`")
    folder = tmp_path_factory.mktemp("chaos")
    report = folder / "CHAOS.md"
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli.main", "chaos", "--minutes", "2", "--seed", "11",
         "--sessions", "30", "--toxiproxy", str(binary), "--report", str(report),
         "--workdir", str(folder / "work")],
        cwd=ROOT, capture_output=True, text=True, timeout=1400, check=False)
    return Campaign(done.returncode, done.stderr,
                    report.read_text() if report.exists() else "")


@pytest.mark.cluster
@pytest.mark.jars
@pytest.mark.long
@pytest.mark.timeout(1500)
def test_short_campaign_holds_every_invariant(campaign: Campaign) -> None:
    """Every fault kind ran, every invariant held, and the command says so (exit 0)."""
    text = campaign.report
    assert text, f"no report; exit {campaign.returncode}\n{campaign.stderr[-6000:]}"
    for kind in ("kill-driver", "kill-processors", "kill-broker", "stop-driver",
                 "stop-processors",
                 *(f"net-{t}" for t in TOXICS), *(f"provider-{k}" for k in FAULT_KINDS),
                 *(f"garbage-{g}" for g in GARBAGE)):
        assert re.search(rf"^\| {re.escape(kind)} \| [1-9]", text, re.M), kind
    invariants = campaign.invariants()
    assert len(invariants) >= 9 and INBOX_ONCE in invariants, invariants
    broken = {name: result for name, result in invariants.items() if result != "held"}
    assert not broken, f"{broken}\n{text}"
    assert campaign.returncode == 0, f"{campaign.stderr[-6000:]}\n{text}"
    assert "Result: **PASS**" in text
