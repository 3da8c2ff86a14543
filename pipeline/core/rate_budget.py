"""Provider rate budgets: token buckets per (provider, model), shared fairly (issue 30).

Pure and synchronous: time is a number the caller passes (``now``, seconds on a monotonic
clock), nothing sleeps. An adapter turns :meth:`RateBudget.next_grant` into awaits.

Rules this module keeps:

- A budget has two buckets, requests and tokens per minute, each holding at most one
  minute of its (share of the) limit and refilling continuously, at ``HEADROOM`` of it. A
  call takes one request and its *estimated* input tokens before it is made;
  :meth:`RateBudget.settle` corrects the tokens bucket by what the provider reported (the
  bucket may go below zero: later calls wait until it has refilled).
- ``share`` is this process's part of a fleet-wide limit (for a driver, its partitions over
  the topic's): the buckets hold and refill ``share`` of the limit, so the fleet together
  never exceeds it. A new share takes effect at once, without granting anything twice.
- The provider's own signals narrow the budget at once: ``Retry-After`` blocks both buckets
  until then; ``x-ratelimit-remaining-*`` caps a bucket's level (scaled by ``share``, the
  provider counts the whole fleet's calls); the bucket refills on from there, as the
  provider's does (``x-ratelimit-reset-*`` says when the provider's bucket is full again,
  so it blocks nothing).
- Waiting calls are served fairly: round robin over tenants (weighted), and within a tenant
  round robin over sessions, each session's calls in order. One tenant with ten times the
  calls waiting therefore gets one turn in each round, like every other tenant.
- A tenant may have limits of its own, held within each (provider, model) budget by buckets
  of the same kind (at the same share): a tenant out of its own budget is passed over, and
  the others are served meanwhile.

A step that has to wait for its grant says so in the log, so the fleet's status row shows
it (how long, for which model) from the log alone: an ignorable :data:`PROVIDER_WAIT_TYPE`
event when the wait begins, and an ignorable :data:`PROVIDER_GRANTED_TYPE` event with the
time waited when the grant comes. A call granted at once logs neither::

    {"type": "dsh-pipeline/provider-wait", "ignorable": true,
     "data": {"provider": "deepseek", "model": "deepseek-chat"}}
    {"type": "dsh-pipeline/provider-granted", "ignorable": true,
     "data": {"provider": "deepseek", "model": "deepseek-chat", "waitedMs": 1830}}
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from pipeline.core.errors import ConfigError
from pipeline.core.events import JsonValue
from pipeline.core.tenants import checked_tenant

PROVIDER_WAIT_TYPE: Final = "dsh-pipeline/provider-wait"
PROVIDER_GRANTED_TYPE: Final = "dsh-pipeline/provider-granted"
MINUTE_S = 60.0
EPSILON = 1e-6
# The budget grants 95% of a limit: a grant is counted when it is made, the provider counts
# the request when it arrives (later, and later still in a burst), so a bucket refilling at
# the full rate runs a little ahead of the provider's and the next grant would be refused.
HEADROOM = 0.95


@dataclass(slots=True)
class TokenBucket:
    """``per_minute`` units a minute, at most a minute's worth held; ``level`` may be < 0."""

    per_minute: float
    level: float
    at: float
    blocked_until: float = 0.0   # a provider's Retry-After: no refill before then

    @classmethod
    def full(cls, per_minute: float, now: float) -> TokenBucket:
        return cls(per_minute, per_minute, now)

    def refill(self, now: float) -> None:
        if now > self.at:
            if now >= self.blocked_until:
                self.level = min(self.per_minute,
                                 self.level + (now - self.at) * self.per_minute / MINUTE_S)
            self.at = now

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` is available (0: now). An amount above the bucket's size
        waits for a full bucket: it is granted then, and the level goes below zero."""
        self.refill(now)
        wanted = min(amount, self.per_minute)
        if self.level >= wanted - EPSILON:   # refills are float sums: never wait for dust
            return 0.0
        start = max(now, self.blocked_until)
        return start - now + (wanted - self.level) * MINUTE_S / max(self.per_minute, 1e-9)

    def queue_wait_s(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` (the calls waiting and one more) is available, not
        capped at the bucket's size: what a call enqueued now would wait, about."""
        self.refill(now)
        if self.level >= amount - EPSILON:
            return 0.0
        start = max(now, self.blocked_until)
        return start - now + (amount - self.level) * MINUTE_S / max(self.per_minute, 1e-9)

    def cap(self, remaining: float, now: float) -> None:
        """The provider says only ``remaining`` is left now (its bucket refills on, as
        this one does)."""
        self.refill(now)
        if remaining < self.level:
            self.level = remaining

    def block(self, until: float, now: float) -> None:
        """Nothing is left, and nothing refills, until ``until`` (a ``Retry-After``)."""
        self.cap(min(self.level, 0.0), now)
        self.blocked_until = max(self.blocked_until, until)


@dataclass(frozen=True, slots=True)
class Limit:
    """A provider's limits for one model (None: not limited)."""

    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"provider limit {name} must be > 0, got {value!r}")


@dataclass(slots=True)
class Ticket:
    """One call waiting for the budget."""

    tenant: str
    session_id: str
    tokens: int      # estimated input tokens
    number: int = 0  # set by the budget: the order calls arrived in


@dataclass(slots=True)
class _Buckets:
    """A requests bucket and a tokens bucket of one limit at a share: the budget's own,
    and each tenant's own within it."""

    limit: Limit
    requests: TokenBucket | None
    tokens: TokenBucket | None

    @classmethod
    def of(cls, limit: Limit, share: float, now: float) -> _Buckets:
        def bucket(per_minute: float | None) -> TokenBucket | None:
            return None if per_minute is None else TokenBucket.full(
                per_minute * share * HEADROOM, now)
        return cls(limit, bucket(limit.requests_per_minute), bucket(limit.tokens_per_minute))

    def wait_s(self, tokens: int, now: float) -> float:
        return max(0.0 if self.requests is None else self.requests.wait_s(1, now),
                   0.0 if self.tokens is None else self.tokens.wait_s(tokens, now))

    def take(self, tokens: int) -> None:
        if self.requests is not None:
            self.requests.level -= 1
        if self.tokens is not None:
            self.tokens.level -= tokens

    def reshare(self, old: float, new: float, now: float) -> None:
        for bucket, per_minute in ((self.requests, self.limit.requests_per_minute),
                                   (self.tokens, self.limit.tokens_per_minute)):
            if bucket is not None and per_minute is not None:
                bucket.refill(now)
                bucket.per_minute = per_minute * new * HEADROOM
                bucket.level = min(bucket.level * new / old, bucket.per_minute)


@dataclass(slots=True)
class _Tenant:
    weight: int
    credit: int = 0
    sessions: OrderedDict[str, deque[Ticket]] = field(default_factory=OrderedDict)


class RateBudget:
    """The budget of one (provider, model): its buckets and its fair queue of waiting calls."""

    def __init__(self, limit: Limit, now: float, *, share: float = 1.0,
                 weights: dict[str, int] | None = None,
                 tenant_limits: dict[str, Limit] | None = None) -> None:
        self.limit = limit
        self.share = share
        self.weights = {tenant: max(1, int(w)) for tenant, w in (weights or {}).items()}
        self.buckets = _Buckets.of(limit, share, now)
        self.tenant_buckets = {tenant: _Buckets.of(own, share, now)
                               for tenant, own in (tenant_limits or {}).items()}
        self._tenants: OrderedDict[str, _Tenant] = OrderedDict()
        self._arrived = 0

    @property
    def requests(self) -> TokenBucket | None:
        return self.buckets.requests

    @property
    def tokens(self) -> TokenBucket | None:
        return self.buckets.tokens

    # --- the queue ---------------------------------------------------------------------

    def enqueue(self, ticket: Ticket) -> Ticket:
        self._arrived += 1
        ticket.number = self._arrived
        tenant = self._tenants.get(ticket.tenant)
        if tenant is None:
            tenant = self._tenants[ticket.tenant] = _Tenant(self.weights.get(ticket.tenant, 1))
        tenant.sessions.setdefault(ticket.session_id, deque()).append(ticket)
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """A waiting call that gave up (its turn was cancelled)."""
        tenant = self._tenants.get(ticket.tenant)
        queue = tenant.sessions.get(ticket.session_id) if tenant else None
        if tenant is None or queue is None or ticket not in queue:
            return
        queue.remove(ticket)
        if not queue:
            del tenant.sessions[ticket.session_id]
        if not tenant.sessions:
            del self._tenants[ticket.tenant]

    @property
    def waiting(self) -> int:
        return sum(len(q) for t in self._tenants.values() for q in t.sessions.values())

    def next_grant(self, now: float) -> tuple[Ticket | None, float]:
        """The call granted now (taken from the queue and the buckets), or None and the
        seconds until the next one may be (0: nothing waits)."""
        head, tenant_wait = self._head(now)
        if head is None:
            return None, tenant_wait
        wait = self.buckets.wait_s(head.tokens, now)
        if wait > 0:
            return None, wait
        self._take(head)
        return head, 0.0

    def wait_estimate(self, tokens: int, now: float) -> float:
        """About how long a call of ``tokens`` enqueued now would wait for its grant (behind
        every call waiting): what a fallback decision compares with its bound. Nothing is
        taken or enqueued."""
        tickets = [t for tenant in self._tenants.values() for q in tenant.sessions.values()
                   for t in q]
        requests = self._queue_wait(self.requests, len(tickets) + 1, now)
        tokens_wait = self._queue_wait(self.tokens, sum(t.tokens for t in tickets) + tokens,
                                       now)
        return max(requests, tokens_wait)

    @staticmethod
    def _queue_wait(bucket: TokenBucket | None, amount: float, now: float) -> float:
        return 0.0 if bucket is None else bucket.queue_wait_s(amount, now)

    def _head(self, now: float) -> tuple[Ticket | None, float]:
        """The next call in fair order: the first tenant with credit (weighted round robin)
        and room in its own buckets, its first session's first call; else None and the
        seconds until a tenant's own buckets have room (0: nothing waits)."""
        if not self._tenants:
            return None, 0.0
        tenant_wait = float("inf")
        for _ in range(2):  # the second pass after every credit is renewed
            for name, tenant in self._tenants.items():
                if tenant.credit > 0:
                    ticket = next(iter(tenant.sessions.values()))[0]
                    own = self.tenant_buckets.get(name)
                    wait = 0.0 if own is None else own.wait_s(ticket.tokens, now)
                    if wait <= 0:
                        return ticket, 0.0
                    tenant_wait = min(tenant_wait, wait)
            for tenant in self._tenants.values():
                tenant.credit = tenant.weight
        return None, tenant_wait

    def _take(self, ticket: Ticket) -> None:
        tenant = self._tenants[ticket.tenant]
        tenant.credit -= 1
        queue = tenant.sessions.pop(ticket.session_id)
        queue.popleft()
        if queue:
            tenant.sessions[ticket.session_id] = queue   # to the back: round robin
        self._tenants.move_to_end(ticket.tenant)
        if not tenant.sessions:
            del self._tenants[ticket.tenant]
        self.buckets.take(ticket.tokens)
        own = self.tenant_buckets.get(ticket.tenant)
        if own is not None:
            own.take(ticket.tokens)

    # --- what the provider said ----------------------------------------------------------

    def settle(self, estimated: int, reported: int, now: float, *, tenant: str = "") -> None:
        """A call's input tokens as reported: the tokens buckets (the budget's and the
        call's tenant's own) give back or take more."""
        own = self.tenant_buckets.get(tenant)
        for bucket in (self.tokens, own.tokens if own is not None else None):
            if bucket is not None:
                bucket.refill(now)
                bucket.level += estimated - reported

    def retry_after(self, seconds: float, now: float) -> None:
        """``Retry-After``: nothing is granted before ``now + seconds``."""
        for bucket in (self.requests, self.tokens):
            if bucket is not None:
                bucket.block(now + seconds, now)

    def provider_remaining(self, *, requests: float | None, tokens: float | None,
                           now: float) -> None:
        """``x-ratelimit-remaining-*``: this process's share of what is left now. The
        buckets refill on from there: a provider's ``x-ratelimit-reset-*`` is when its
        bucket is full again, not when the next call may go, so it blocks nothing."""
        if self.requests is not None and requests is not None:
            self.requests.cap(requests * self.share, now)
        if self.tokens is not None and tokens is not None:
            self.tokens.cap(tokens * self.share, now)

    def reshare(self, share: float, now: float) -> None:
        """This process's new part of the fleet's limit (a rebalance moved partitions)."""
        if not 0 < share <= 1:
            raise ConfigError(f"a budget share must be in (0, 1], got {share!r}")
        for buckets in (self.buckets, *self.tenant_buckets.values()):
            buckets.reshare(self.share, share, now)
        self.share = share


@dataclass(frozen=True, slots=True)
class RateSignal:
    """What a provider's ``x-ratelimit-*`` headers said about the whole fleet's budget."""

    requests_remaining: float | None = None
    tokens_remaining: float | None = None
    # when the provider's buckets are full again: what the headers say, blocking nothing
    requests_reset_s: float = 0.0
    tokens_reset_s: float = 0.0


def observe(budget: RateBudget, signal: RateSignal, now: float) -> None:
    """Narrow ``budget`` by a provider's signal (:meth:`RateBudget.provider_remaining`)."""
    budget.provider_remaining(requests=signal.requests_remaining,
                              tokens=signal.tokens_remaining, now=now)


# --- configuration ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProviderLimits:
    """``DSH_PROVIDER_LIMITS``: limits by ``provider/model`` (``provider/*`` and ``*`` are
    defaults, the most specific wins), tenants' weights in the fair queue and tenants' own
    limits (held within each budget)."""

    limits: dict[str, Limit] = field(default_factory=dict)
    weights: dict[str, int] = field(default_factory=dict)
    tenant_limits: dict[str, Limit] = field(default_factory=dict)

    def limit_of(self, provider: str, model: str) -> Limit | None:
        for key in (f"{provider}/{model}", f"{provider}/*", "*"):
            if key in self.limits:
                return self.limits[key]
        return None


LIMITS_EXAMPLE = ('{"deepseek/deepseek-chat": {"requests_per_minute": 500, '
                  '"tokens_per_minute": 1000000}, "tenants": {"acme": {"weight": 2, '
                  '"requests_per_minute": 100}}}')
_LIMIT_NAMES = frozenset({"requests_per_minute", "tokens_per_minute"})


def parse_limits(raw: object) -> ProviderLimits:
    """The limits of a decoded ``DSH_PROVIDER_LIMITS`` JSON object; ConfigError naming the
    entry that is wrong."""
    if not isinstance(raw, dict):
        raise ConfigError(f"DSH_PROVIDER_LIMITS must be a JSON object, e.g. {LIMITS_EXAMPLE}")
    limits: dict[str, Limit] = {}
    weights: dict[str, int] = {}
    tenant_limits: dict[str, Limit] = {}
    for key, value in raw.items():
        if key == "tenants":
            weights, tenant_limits = _tenants(value)
            continue
        if not isinstance(value, dict) or not set(value) <= _LIMIT_NAMES:
            raise ConfigError(f"DSH_PROVIDER_LIMITS[{key!r}] must be an object with "
                              "requests_per_minute and/or tokens_per_minute")
        if key != "*" and "/" not in key:
            raise ConfigError(f"DSH_PROVIDER_LIMITS key {key!r} must be provider/model, "
                              "provider/* or *")
        where = f"DSH_PROVIDER_LIMITS[{key!r}]"
        limits[key] = Limit(**{name: _number(where, name, v) for name, v in value.items()})
    return ProviderLimits(limits, weights, tenant_limits)


def _number(where: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}.{name} must be a number, got {value!r}")
    return float(value)


def _tenants(raw: object) -> tuple[dict[str, int], dict[str, Limit]]:
    """Tenants' weights and own limits: ``{T: {"weight"?, "requests_per_minute"?,
    "tokens_per_minute"?}}``."""
    if not isinstance(raw, dict):
        raise ConfigError('DSH_PROVIDER_LIMITS["tenants"] must be an object of tenants')
    weights, limits = {}, {}
    for tenant, entry in raw.items():
        where = f'DSH_PROVIDER_LIMITS["tenants"][{tenant!r}]'
        checked_tenant(tenant)
        if not isinstance(entry, dict) or not entry or not set(entry) <= _LIMIT_NAMES | {
                "weight"}:
            raise ConfigError(f"{where} must be an object of weight, requests_per_minute "
                              "and/or tokens_per_minute")
        weight = entry.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
            raise ConfigError(f"{where}.weight must be an integer >= 1, got {weight!r}")
        weights[tenant] = weight
        own = {name: _number(where, name, entry[name]) for name in _LIMIT_NAMES & set(entry)}
        if own:
            limits[tenant] = Limit(**own)
    return weights, limits


def estimated_tokens(messages: Iterable[JsonValue], system: str | None = None) -> int:
    """Input tokens estimated before a call: about four characters a token (at least one).

    The characters counted are those of every string in ``messages`` (object keys and
    values, at any depth) and of ``system``; numbers, booleans and nulls count nothing. They
    are summed by a walk, without serialising the messages (the provider does that once),
    so the estimate is below its JSON body's length over four by the body's punctuation.
    :meth:`RateBudget.settle` corrects it from what the provider reports.
    """
    return max(1, (text_characters(list(messages)) + len(system or "")) // 4)


def text_characters(value: JsonValue) -> int:
    """The characters of every string in ``value``: object keys and values, at any depth
    (lists and tuples walked); numbers, booleans and nulls count nothing."""
    total = 0
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(key) for key in item)
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
    return total
