"""The one error tree of dsh-pipeline.

Every failure a caller can act on is one of these; foreign exceptions (aiokafka, httpx,
fastavro, OS errors) are translated into this tree at the adapter that meets them, in one
place per adapter, so services and the CLI never catch a library's exception type.

    DshError
    ├── EventError              an event breaks a rule of the session-log model
    │   └── SequenceError       seq gap or repeat (carries expected and found seq)
    ├── SessionFileError        a dsh session file cannot be read (path, line)
    ├── CodecError              bytes that do not decode / an event that does not encode
    │   └── SchemaError         unknown schema id or fingerprint, incompatible schema
    ├── TurnError               the turn state machine was driven out of order (a bug)
    │   └── InvariantViolation  a model request differs from what the log derives
    ├── ConfigError             bad settings or arguments (secret values never included)
    └── TransportError          a broker, registry or provider could not be reached/used
        ├── BrokerError         Kafka (topic mismatch, fencing, timeouts)
        ├── RegistryError       schema registry HTTP errors
        ├── ProviderError       model provider errors, with a code (AUTH, RATE_LIMIT, ...)
        └── ToolServerError     an MCP tool server failed, with a code (UNAVAILABLE, ...)

Messages are written for the operator: they name what was wrong, where, and what to do.
They never contain secret values.
"""

from __future__ import annotations


class DshError(Exception):
    """Base of every error dsh-pipeline raises on purpose."""


class EventError(DshError):
    """An event breaks a rule. Names the seq, the type and the rule broken."""

    def __init__(self, message: str, *, seq: int | None = None, type: str | None = None,
                 rule: str = "") -> None:
        where = []
        if seq is not None:
            where.append(f"seq {seq}")
        if type is not None:
            where.append(f"type {type!r}")
        prefix = f"{', '.join(where)}: " if where else ""
        suffix = f" [rule: {rule}]" if rule else ""
        super().__init__(f"{prefix}{message}{suffix}")
        self.seq = seq
        self.type = type
        self.rule = rule
        self.detail = message


class SequenceError(EventError):
    """A seq that repeats or skips ahead of the next expected one."""

    def __init__(self, *, expected: int, found: int, type: str | None = None) -> None:
        kind = "gap" if found > expected else "repeat"
        super().__init__(f"expected seq {expected}, found {found} ({kind})", seq=found,
                         type=type, rule="seq-contiguous")
        self.expected = expected
        self.found = found


class SessionFileError(DshError):
    """A session file cannot be read: names the path and the line."""

    def __init__(self, message: str, *, path: str | None = None,
                 line: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.line = line


class CodecError(DshError):
    """Bytes that cannot be decoded, or an event that cannot be encoded."""


class SchemaError(CodecError):
    """An unknown schema id/fingerprint, or an incompatible schema."""


class TurnError(DshError):
    """The turn state machine was driven out of order: a bug in the caller."""


class InvariantViolation(TurnError):
    """A model request differs from what the log derives: a bug, fail loudly."""


class ConfigError(DshError):
    """Bad settings or arguments. Never includes a secret's value."""


class TransportError(DshError):
    """A broker, registry or provider could not be reached or used."""


class BrokerError(TransportError):
    """Kafka failed: unreachable, topic mismatch, fenced producer, timeout."""


class ToolServerError(TransportError):
    """An MCP tool server could not be reached or used. ``code`` is UNAVAILABLE (not
    connected, restarting), CONNECTION_CLOSED (it went away mid-call), PROTOCOL (a JSON-RPC
    error or a malformed answer) or TIMEOUT. The message names the server, never its env or
    headers."""

    def __init__(self, message: str, *, server: str, code: str) -> None:
        super().__init__(message)
        self.server = server
        self.code = code


class RegistryError(TransportError):
    """The schema registry answered with an error or could not be reached."""


class ProviderError(TransportError):
    """A model provider failed. ``code`` is AUTH, RATE_LIMIT, SERVER, ... ."""

    def __init__(self, message: str, *, code: str, status: int | None = None,
                 retry_after_ms: int | None = None, request_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status
        self.retry_after_ms = retry_after_ms
        self.request_id = request_id

    @property
    def retriable(self) -> bool:
        return self.code in {"RATE_LIMIT", "SERVER", "NETWORK", "TIMEOUT", "OVERLOADED"}
