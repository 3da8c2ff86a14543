"""``dsh-pipeline usage``: the cost ledger, per tenant, provider/model and hour.

Reads the ledger rows (``tenant/...`` records, :mod:`pipeline.core.ledger`) of the compacted
``<prefix>usage`` topic up to its end offsets (read committed), never the session topic: a
processors worker must have run over the sessions. An hour row is shown when its start lies
in ``[--from, --to)``. Costs are nano-unit sums of the price table's currency shown with 9
decimal places (docs/costs.md); a row with calls that had no price says how many, and a row
without any priced call has no cost ("-" in the table, null in JSON), never 0.
Undecodable records are counted on stderr, never fatal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, Final

from pipeline.adapters.kafka.compacted import CompactedFollow
from pipeline.adapters.registry.outputs import output_decoder
from pipeline.codec.output_views import OutputView
from pipeline.codec.outputs import USAGE_RECORD
from pipeline.core.errors import BrokerError, ConfigError
from pipeline.core.events import JsonValue
from pipeline.core.ledger import KIND, LedgerLine
from pipeline.core.prices import format_nanos
from pipeline.core.tenants import checked_tenant
from pipeline.settings import Settings

COLUMNS: Final = ("tenant", "provider/model", "hour (UTC)", "in", "cached", "cache write",
                  "out", "calls", "cost", "unpriced calls")
LEFT: Final = 3   # the first columns are text, the others numbers


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "usage", help="print the cost ledger: tokens and cost per tenant, model and hour",
        description="Print the cost ledger (tokens in, cached, cache write, out, calls and "
                    "cost per tenant, provider/model and hour, UTC) from the processors' "
                    "compacted usage topic, never the session topic. Costs are priced by "
                    "the processors with DSH_PRICES (docs/costs.md): 9 decimal places of the "
                    "price table's currency; calls without a price are counted apart and "
                    "never cost 0. A processors worker must have run.")
    parser.add_argument("--tenant", default=None,
                        help="only this tenant (\"\" for the default tenant; default: all)")
    parser.add_argument("--from", dest="since", default=None, metavar="ISO",
                        help="hours starting at or after this ISO 8601 date or time (UTC "
                             "when it has no offset), e.g. 2025-09-05 or 2025-09-05T08:00Z")
    parser.add_argument("--to", dest="until", default=None, metavar="ISO",
                        help="hours starting before this ISO 8601 date or time")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (rows and totals) instead of a table")
    parser.set_defaults(func=run_usage)


def run_usage(args: argparse.Namespace, settings: Settings) -> int:
    tenant = None if args.tenant is None else checked_tenant(args.tenant)
    since = None if args.since is None else instant_ms(args.since, "--from")
    until = None if args.until is None else instant_ms(args.until, "--to")
    if since is not None and until is not None and since >= until:
        raise ConfigError(f"--from {args.since} is not before --to {args.until}")
    view = asyncio.run(read_ledger(settings, tenant))
    lines = ledger_lines(view.values.values(), since, until)
    if view.undecodable:
        print(f"usage: {view.undecodable} undecodable records skipped (last: "
              f"{list(view.problems)[-1]})", file=sys.stderr)
    if args.json:
        print(json.dumps({"tenant": tenant, "from": since, "to": until,
                          "rows": [line.to_json() for line in lines],
                          "totals": totals(lines)}), flush=True)
    else:
        print(render_table(lines), flush=True)
    return 0


def instant_ms(text: str, flag: str) -> int:
    """An ISO 8601 date or time (naive means UTC, as for ``tail --from-time``) in epoch ms."""
    try:
        moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give an ISO 8601 date or time, e.g. 2025-09-05 "
                          "or 2025-09-05T08:00:00Z") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    delta = moment - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


async def read_ledger(settings: Settings, tenant: str | None) -> OutputView:
    """The usage topic's ledger rows (of ``tenant``, or every one) up to its end offsets."""
    prefix = (f"{KIND}/" if tenant is None else f"{KIND}/{tenant}/").encode()
    topic = settings.topics.usage
    view = OutputView(output_decoder(settings), USAGE_RECORD)
    async with CompactedFollow(settings, [topic]) as follow:
        if follow.missing:
            raise BrokerError(f"topic {topic} does not exist: run `dsh-pipeline topics "
                              "ensure` and a processors worker (`dsh-pipeline processors`)")
        async for batch in follow.snapshot():
            for record in batch:
                if (record.key or b"").startswith(prefix):
                    view.apply(record)
    return view


def ledger_lines(values: Iterable[dict[str, JsonValue]], since: int | None,
                 until: int | None) -> list[LedgerLine]:
    """The rows whose hour starts in ``[since, until)``, by tenant, model and hour. A value
    that is not a ledger row raises ValueError (its key said it was one)."""
    lines = [LedgerLine.from_record(value) for value in values]
    kept = [line for line in lines if (since is None or line.start_ms >= since)
            and (until is None or line.start_ms < until)]
    return sorted(kept, key=lambda line: (line.tenant, line.model_key, line.start_ms))


def totals(lines: list[LedgerLine]) -> dict[str, JsonValue]:
    """The sums of the rows; ``costNanos`` the sum of the rows' costs (null: none priced)."""
    costs = [line.cost_nanos for line in lines if line.cost_nanos is not None]
    return {"inputTokens": sum(line.input_tokens for line in lines),
            "cachedInputTokens": sum(line.cached_input_tokens for line in lines),
            "cacheWriteTokens": sum(line.cache_write_tokens for line in lines),
            "outputTokens": sum(line.output_tokens for line in lines),
            "calls": sum(line.calls for line in lines),
            "costNanos": sum(costs) if costs else None,
            "unpricedCalls": sum(line.unpriced_calls for line in lines),
            "unpricedTokens": sum(line.unpriced_tokens for line in lines)}


def render_table(lines: list[LedgerLine]) -> str:
    rows = [list(COLUMNS)]
    rows += [[line.tenant or '""', line.model_key, _hour(line.start_ms),
              *_numbers(line.input_tokens, line.cached_input_tokens, line.cache_write_tokens,
                        line.output_tokens, line.calls),
              _cost(line.cost_nanos), f"{line.unpriced_calls:,}"] for line in lines]
    total = totals(lines)
    cost = total["costNanos"]
    rows.append(["total", "", "", *_numbers(*(int(str(total[name])) for name in (
        "inputTokens", "cachedInputTokens", "cacheWriteTokens", "outputTokens", "calls"))),
        _cost(cost if isinstance(cost, int) else None), f"{total['unpricedCalls']:,}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    text = ["  ".join(cell.ljust(w) if i < LEFT else cell.rjust(w)
                      for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()
            for row in rows]
    note = ("; cost: nano-unit sums of the price table's currency, '-' where no call had "
            "a price")
    return "\n".join([*text, f"{len(lines)} rows{note}"])


def _numbers(*values: int) -> list[str]:
    return [f"{value:,}" for value in values]


def _cost(nanos: int | None) -> str:
    return "-" if nanos is None else format_nanos(nanos)


def _hour(start_ms: int) -> str:
    return datetime.fromtimestamp(start_ms / 1000, UTC).strftime("%Y-%m-%dT%H:%MZ")
