"""The campaign's cost-ledger invariant, and its price table.

After the fleet settles, the usage topic's ledger rows (``tenant/...`` keys, read as
``dsh-pipeline usage`` reads them) must equal, key by key, the ledger computed directly from
the session topic's logs (:class:`pipeline.core.ledger.Ledger`, with the campaign's
``DSH_PRICES``): tokens, calls, cost to the nano-unit, unpriced calls. And the usage of the
driven sessions must be what the provider server reported: each ``assistant/message`` with
usage names the generated answer it came from
(:func:`~dsh_dev.chaos.answers.answer_id_of`), whose usage chunk the server wrote
(:attr:`~dsh_dev.chaos.provider_server.LLMTestServer.reported`) with the same
counts; no answer is in the logs twice; and the tokens of the ledger's rows of the campaign's
provider equal the tokens the server reported for the answers in the logs. An answer whose
usage the server wrote but that no log holds (a driver killed or fenced, or a cancel, before
the end of its stream was committed) is noted, not a violation: nobody logged it, nobody is
billed for it.

:func:`chaos_prices` is the table the processors workers get: one model's price changes
during the run, the other is priced by the provider's ``*`` entry, and the shipped sessions'
model has no price (its calls are counted unpriced, never as 0).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from dsh_dev.chaos.answers import answer_id_of
from dsh_dev.chaos.bounded import run_bounded
from dsh_dev.chaos.invariants import Result
from dsh_dev.chaos.load import MODELS, PROVIDER
from dsh_dev.chaos.provider_server import ReportedUsage
from pipeline.cli.cmd_usage import read_ledger, totals
from pipeline.core.errors import DshError
from pipeline.core.events import Event, JsonValue
from pipeline.core.ledger import Ledger, LedgerLine
from pipeline.core.prices import PriceTable, format_nanos
from pipeline.core.usage import SessionUsage, TokenCounts, UsageSample
from pipeline.settings import Settings

LEDGER_BUDGET_S: Final = 120.0
READ_BUDGET_S: Final = 60.0
EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
Rows = dict[str, dict[str, JsonValue]]


def chaos_prices(change_ms: int) -> str:
    """The campaign's ``DSH_PRICES``: ``chaos-model-a`` repriced at ``change_ms`` (epoch
    ms), every other model of the provider at its ``*`` price."""
    change = (EPOCH + timedelta(milliseconds=change_ms)).isoformat(timespec="milliseconds")
    return json.dumps({
        f"{PROVIDER}/{MODELS[0]}": [
            {"from": "2020-01-01", "input": "0.27", "cached_input": "0.07", "output": "1.10"},
            {"from": change, "input": "0.28", "cached_input": "0.028", "output": "0.42"}],
        f"{PROVIDER}/*": {"from": "2020-01-01", "input": "2.50", "cached_input": "1.25",
                          "output": "10"}})


@dataclass(slots=True)
class Reference:
    """The ledger computed directly from the logs, and the usage samples it summed."""

    rows: Rows
    samples: list[UsageSample]


def reference_ledger(logs: Mapping[str, Sequence[Event]], prices: PriceTable) -> Reference:
    ledger = Ledger(prices)
    samples: list[UsageSample] = []
    for session_id, events in logs.items():
        state = SessionUsage()
        for event in events:
            sample = state.apply(session_id, event)
            if sample is not None:
                ledger.add(sample)
                samples.append(sample)
    return Reference(ledger.records(), samples)


async def ledger_on_topic(settings: Settings, expected: Rows,
                          budget_s: float = LEDGER_BUDGET_S) -> tuple[Rows, str | None]:
    """The usage topic's ledger rows, read again (every 2 s, bounded) until they equal
    ``expected``: the usage stage publishes after the session stage; and the last read
    error, if any."""
    deadline = time.monotonic() + budget_s
    rows: Rows = {}
    error: str | None = None
    while True:
        try:
            view = await run_bounded(lambda: read_ledger(settings, None), READ_BUDGET_S)
            rows, error = dict(view.values), None
        except (DshError, TimeoutError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        if rows == expected or time.monotonic() > deadline:
            return rows, error
        await asyncio.sleep(2.0)


def row_problems(expected: Rows, found: Rows) -> list[str]:
    """Every key whose row differs: missing, extra, or which fields."""
    problems = []
    for key in sorted(expected.keys() | found.keys()):
        want, got = expected.get(key), found.get(key)
        if got is None:
            problems.append(f"ledger row {key}: not on the usage topic")
        elif want is None:
            problems.append(f"ledger row {key}: on the usage topic, not in the logs' ledger")
        elif got != want:
            names = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
            problems.append(f"ledger row {key}: " + "; ".join(
                f"{k} {got.get(k)!r} on the topic, {want.get(k)!r} from the logs"
                for k in names))
    return problems


@dataclass(slots=True)
class ProviderTally:
    """The driven sessions' usage against what the provider server reported."""

    answers: int = 0    # answers whose usage is in the logs
    tokens: int = 0     # the tokens the server reported for them
    problems: list[str] = field(default_factory=list)
    unlogged: int = 0   # answers the server reported that no log holds
    unlogged_tokens: int = 0


def provider_tally(logs: Mapping[str, Sequence[Event]],
                   reported: Sequence[ReportedUsage]) -> ProviderTally:
    """Each logged usage against the reported usage of the answer it names."""
    by_answer = {item.completion_id: item.usage for item in reported}
    tally = ProviderTally()
    seen: dict[str, str] = {}
    for session_id, events in logs.items():
        for event in events:
            data = event.data if isinstance(event.data, dict) else {}
            usage, message = data.get("usage"), data.get("message")
            if event.type != "assistant/message" or usage is None:
                continue
            where = f"session {session_id} seq {event.seq}"
            answer = answer_id_of(message) if isinstance(message, dict) else None
            problem = _answer_problem(answer, by_answer, seen, where)
            if problem is None:
                assert answer is not None
                seen[answer] = where
                tally.answers += 1
                tally.tokens += _reported_tokens(by_answer[answer])
                problem = _usage_problem(by_answer[answer], TokenCounts.from_dsh(usage), where,
                                         answer)
            if problem is not None:
                tally.problems.append(problem)
    for answer, usage in by_answer.items():
        if answer not in seen:
            tally.unlogged += 1
            tally.unlogged_tokens += _reported_tokens(usage)
    return tally


def _answer_problem(answer: str | None, by_answer: Mapping[str, Any], seen: Mapping[str, str],
                    where: str) -> str | None:
    if answer is None:
        return f"{where}: usage from no answer of the provider server (no answer id)"
    if answer in seen:
        return f"{where}: the usage of {answer} again (first at {seen[answer]})"
    if answer not in by_answer:
        return f"{where}: usage of {answer}, whose usage the provider server never sent"
    return None


def _reported_tokens(usage: Mapping[str, Any]) -> int:
    return int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))


def _usage_problem(usage: Mapping[str, Any], counts: TokenCounts, where: str,
                   answer: str) -> str | None:
    """The provider's counts (prompt tokens include cached ones) against dsh's disjoint
    counts."""
    logged = (counts.input_tokens + counts.cache_read_tokens + counts.cache_write_tokens,
              counts.cache_read_tokens, counts.output_tokens)
    sent = (int(usage.get("prompt_tokens", 0)), int(usage.get("prompt_cache_hit_tokens", 0)),
            int(usage.get("completion_tokens", 0)))
    if logged == sent:
        return None
    return (f"{where}: {answer} reported (prompt, cached, completion) {sent}, the log "
            f"holds {logged}")


def check_ledger(reference: Reference, found: Rows, driven: Mapping[str, Sequence[Event]],
                 reported: Sequence[ReportedUsage], *, price_change_ms: int | None = None,
                 read_error: str | None = None) -> Result:
    """The invariant: ``found`` (the usage topic's rows) equals the reference key by key,
    and the ``driven`` sessions' usage is what the provider server ``reported``."""
    result = Result("the usage topic's cost ledger equals the logs' ledger and the "
                    "provider-reported usage", True, "")
    if read_error is not None:
        result.add(f"the usage topic could not be read: {read_error}")
    problems = row_problems(reference.rows, found)
    for problem in problems:
        result.add(problem)
    tally = provider_tally(driven, reported)
    for problem in tally.problems:
        result.add(problem)
    lines = [LedgerLine.from_record(row) for row in reference.rows.values()]
    ledger_tokens = sum(line.input_tokens + line.cached_input_tokens + line.cache_write_tokens
                        + line.output_tokens for line in lines if line.provider == PROVIDER)
    if ledger_tokens != tally.tokens:
        result.add(f"the ledger's {PROVIDER} rows hold {ledger_tokens:,} tokens, the provider "
                   f"server reported {tally.tokens:,} for the answers in the logs")
    result.summary = _summary(lines, len(problems), ledger_tokens == tally.tokens, tally)
    result.notes += _notes(reference.samples, tally, price_change_ms)
    return result


def _summary(lines: list[LedgerLine], differ: int, tokens_equal: bool,
             tally: ProviderTally) -> str:
    total = totals(lines)
    cost = total["costNanos"]
    shown = format_nanos(cost) if isinstance(cost, int) else "none"
    rows = (f"{len(lines)} rows equal" if not differ
            else f"{differ} rows differ of {len(lines)}")
    tokens = ("equal" if tokens_equal and not tally.problems else "DIFFER")
    return (f"ledger: {rows}, cost {shown} ({total['unpricedCalls']} calls unpriced); "
            f"provider-reported tokens {tokens} ({tally.tokens:,} tokens in {tally.answers} "
            "answers)")


def _notes(samples: Sequence[UsageSample], tally: ProviderTally,
           price_change_ms: int | None) -> list[str]:
    notes = []
    if price_change_ms is not None:
        repriced = [s for s in samples if (s.provider, s.model) == (PROVIDER, MODELS[0])]
        before = sum(s.time < price_change_ms for s in repriced)
        stamp = time.strftime("%H:%M:%S", time.gmtime(price_change_ms / 1000))
        notes.append(f"{PROVIDER}/{MODELS[0]}'s price changed at {stamp} UTC: {before} calls "
                     f"before, {len(repriced) - before} after")
    if tally.unlogged:
        notes.append(f"{tally.unlogged} answers ({tally.unlogged_tokens:,} tokens) whose usage "
                     "the provider server sent are in no log (a driver killed or fenced, or a "
                     "cancel, before the end of the stream was committed)")
    return notes
