"""The chaos campaign's cost-ledger invariant, without a broker.

Real logs: the in-memory driver runs sessions in tenants through the real OpenAI-compatible
adapter against the campaign's provider server and generated answers. The usage topic's rows
are stood in for by the reference rows (equal), then changed (a violation naming the row and
the field); the provider server's count of the usage it sent is checked against the logs,
answer by answer (:mod:`dsh_dev.chaos.ledger_check`). The campaign reads the real usage
topic (``tests/chaos/test_chaos_short.py``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsh_dev.chaos.answers import GeneratedAnswers, answer_id_of
from dsh_dev.chaos.campaign import CampaignOptions, Outcome
from dsh_dev.chaos.ledger_check import (
    Reference,
    chaos_prices,
    check_ledger,
    reference_ledger,
)
from dsh_dev.chaos.load import PROVIDER, TENANTS, session_tenants
from dsh_dev.chaos.provider_server import LLMTestServer, ReportedUsage
from dsh_dev.chaos.report import render
from pipeline.adapters.llm.http_provider import OpenAICompatibleProvider
from pipeline.core.events import Event
from pipeline.core.inbox import Configure, FollowUp
from pipeline.core.model import RetryPolicy
from pipeline.core.prices import prices_from_text
from pipeline.services.driver.memory import Driver, MemorySink
from pipeline.services.driver.tools import builtin_registry

SESSIONS = [f"chaos-7-{n:04d}" for n in range(6)]


@dataclasses.dataclass
class Run:
    logs: dict[str, list[Event]]
    reported: list[ReportedUsage]
    answers: GeneratedAnswers


@pytest.fixture
async def run() -> AsyncIterator[Run]:
    """Six sessions, two turns each (tool calls half the time), in their tenants."""
    answers = GeneratedAnswers(seed=7, chunk_pause_s=0.0)
    server = LLMTestServer(answers, keep_requests=False)
    base_url = await server.start()
    provider = OpenAICompatibleProvider(base_url, trust_env=False)
    tenants = session_tenants(SESSIONS)
    driver = Driver(provider_factory=lambda _p, _m: provider, tools=builtin_registry(),
                    retry=RetryPolicy(max_attempts=3, base_ms=1, max_ms=2), jitter=lambda: 0.0)
    try:
        for n, session_id in enumerate(SESSIONS):
            tenant = tenants.get(session_id)
            driver.submit(Configure(session_id, f"{session_id}-c", provider=PROVIDER,
                                    model=("chaos-model-a", "chaos-model-b")[n % 2],
                                    tools=("echo",), tenant=tenant))
            for m in range(2):
                driver.submit(FollowUp(session_id, f"{session_id}-m{m}",
                                       ({"type": "text", "text": "call echo"},), tenant=tenant))
        await driver.drain()
    finally:
        await provider.aclose()
        await server.stop()
    sink = driver.sink
    assert isinstance(sink, MemorySink)
    yield Run(dict(sink.events), list(server.reported), answers)


def reference(run: Run, change_ms: int = 1_700_000_000_000) -> Reference:
    return reference_ledger(run.logs, prices_from_text(chaos_prices(change_ms)))


def test_the_logs_ledger_and_the_provider_reported_usage_agree(run: Run) -> None:
    ref = reference(run)
    result = check_ledger(ref, copy.deepcopy(ref.rows), run.logs, run.reported)
    assert result.ok, result.violations
    tokens = sum(r.usage["prompt_tokens"] + r.usage["completion_tokens"] for r in run.reported)
    assert result.summary.startswith(f"ledger: {len(ref.rows)} rows equal, cost 0.")
    assert result.summary.endswith(f"provider-reported tokens equal ({tokens:,} tokens in "
                                   f"{len(run.reported)} answers)")
    assert len(run.reported) == run.answers.served["answer"] >= 2 * len(SESSIONS)
    assert {row["dsh.tenant"] for row in ref.rows.values()} == {"", "acme", "globex"}
    assert all(row.get("dsh.cost.nanos") for row in ref.rows.values())  # every call priced


def test_each_logged_answer_names_the_answer_the_server_sent(run: Run) -> None:
    named = [answer_id_of(e.data["message"]) for events in run.logs.values() for e in events
             if e.type == "assistant/message"]
    assert sorted(named, key=str) == sorted(r.completion_id for r in run.reported)
    assert len(set(named)) == len(named)


def test_a_row_the_topic_holds_otherwise_is_a_violation_naming_it(run: Run) -> None:
    ref = reference(run)
    found = copy.deepcopy(ref.rows)
    key = sorted(found)[0]
    found[key]["dsh.cost.nanos"] = int(str(found[key]["dsh.cost.nanos"])) + 1
    missing = sorted(found)[-1]
    del found[missing]
    found["tenant/x/hour/0/openai/chaos-model-a"] = ref.rows[key]
    result = check_ledger(ref, found, run.logs, run.reported)
    assert not result.ok
    assert f"ledger row {key}: dsh.cost.nanos" in result.violations[0]
    assert f"ledger row {missing}: not on the usage topic" in result.violations
    assert ("ledger row tenant/x/hour/0/openai/chaos-model-a: on the usage topic, not in "
            "the logs' ledger") in result.violations
    assert result.summary.startswith(f"ledger: 3 rows differ of {len(ref.rows)}")


def test_usage_the_provider_reported_otherwise_is_a_violation(run: Run) -> None:
    ref = reference(run)
    changed = list(run.reported)
    first = changed[0]
    changed[0] = ReportedUsage(first.completion_id, {**first.usage,
                                                     "completion_tokens": 1 + int(
                                                         first.usage["completion_tokens"])})
    result = check_ledger(ref, copy.deepcopy(ref.rows), run.logs, changed)
    assert not result.ok
    assert any(f"{first.completion_id} reported (prompt, cached, completion)" in v
               for v in result.violations)
    assert any("rows hold" in v for v in result.violations)
    assert "provider-reported tokens DIFFER" in result.summary


def test_an_answer_billed_twice_or_never_sent_is_a_violation(run: Run) -> None:
    logs = copy.deepcopy(run.logs)
    first, second = SESSIONS[0], SESSIONS[1]
    billed = next(e for e in logs[first] if e.type == "assistant/message")
    logs[second].append(dataclasses.replace(billed, seq=len(logs[second])))
    ref = reference_ledger(logs, prices_from_text(chaos_prices(1_700_000_000_000)))
    answer = answer_id_of(billed.data["message"])
    result = check_ledger(ref, copy.deepcopy(ref.rows), logs, run.reported)
    assert any(f"the usage of {answer} again" in v for v in result.violations), result
    result = check_ledger(ref, copy.deepcopy(ref.rows), logs,
                          [r for r in run.reported if r.completion_id != answer])
    assert any(f"usage of {answer}, whose usage the provider server never sent" in v
               for v in result.violations), result.violations


def test_a_reported_answer_no_log_holds_is_noted_not_a_violation(run: Run) -> None:
    ref = reference(run)
    extra = ReportedUsage("chatcmpl-chaos-999999", {"prompt_tokens": 70,
                                                    "completion_tokens": 30})
    result = check_ledger(ref, copy.deepcopy(ref.rows), run.logs, [*run.reported, extra])
    assert result.ok, result.violations
    assert any(n.startswith("1 answers (100 tokens) whose usage the provider server sent are "
                            "in no log") for n in result.notes)


def test_the_price_change_splits_the_calls_and_changes_the_cost(run: Run) -> None:
    times = sorted(e.time for events in run.logs.values() for e in events
                   if e.type == "assistant/message")
    before, after = reference(run, times[-1] + 1), reference(run, times[0])
    assert before.rows.keys() == after.rows.keys() and before.rows != after.rows
    result = check_ledger(before, copy.deepcopy(before.rows), run.logs, run.reported,
                          price_change_ms=times[-1] + 1)
    model_a = sum(1 for s in before.samples if s.model == "chaos-model-a")
    assert any("price changed at" in n and f": {model_a} calls before, 0 after" in n
               for n in result.notes), result.notes


def test_three_sessions_in_four_have_a_tenant_and_the_report_says_so() -> None:
    sessions = [f"chaos-1-{n:04d}" for n in range(8)]
    tenants = session_tenants(sessions)
    assert len(tenants) == 6 and set(tenants.values()) == {t for t in TENANTS if t}
    outcome = Outcome(CampaignOptions(1, 8, 20, 40, Path("/tmp")), session_ids=sessions,
                      tenants=tenants, price_change_ms=1_765_000_000_000)
    text = render(outcome, "dsh-pipeline chaos --seed 1")
    assert ("- cost ledger: 6 sessions in tenants `acme`, `globex`, 2 in the default tenant; "
            "`DSH_PRICES` prices `openai/chaos-model-a` (repriced at 05:46:40 UTC)") in text
