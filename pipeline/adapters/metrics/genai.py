"""The GenAI client metrics of the semantic conventions v1.41.0, in Prometheus form.

- ``gen_ai.client.token.usage`` (histogram, ``{token}``) -> ``gen_ai_client_token_usage``,
  one observation per call and token type (``input``: cached input included, as the
  conventions count it; ``output``);
- ``gen_ai.client.operation.duration`` (histogram, ``s``) ->
  ``gen_ai_client_operation_duration_seconds``.

Labels are the attribute names with dots as underscores (the OpenTelemetry-to-Prometheus
translation): ``gen_ai_operation_name``, ``gen_ai_provider_name``, ``gen_ai_request_model``,
``gen_ai_token_type``, and ``error_type`` on the duration ("" when the call succeeded).
Bucket boundaries are the ones the conventions advise.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Histogram

from pipeline.core.usage import TokenCounts

TOKEN_BUCKETS: Final = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576,
                        4194304, 16777216, 67108864)
DURATION_BUCKETS: Final = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
                           20.48, 40.96, 81.92)
TOKEN_USAGE: Final = "gen_ai_client_token_usage"
OPERATION_DURATION: Final = "gen_ai_client_operation_duration_seconds"
_CALL_LABELS: Final = ("gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model")


class GenAiClientMetrics:
    """The two histograms, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.token_usage = Histogram(
            TOKEN_USAGE, "Number of input and output tokens used (gen_ai.client.token.usage)",
            (*_CALL_LABELS, "gen_ai_token_type"), buckets=TOKEN_BUCKETS, registry=registry)
        self.duration = Histogram(
            "gen_ai_client_operation_duration",
            "GenAI operation duration (gen_ai.client.operation.duration)",
            (*_CALL_LABELS, "error_type"), unit="seconds", buckets=DURATION_BUCKETS,
            registry=registry)

    def call(self, provider: str, model: str, seconds: float, *,
             usage: TokenCounts | None = None, error_type: str = "",
             operation: str = "chat") -> None:
        """One model call: its duration and, when it answered, its tokens."""
        self.duration.labels(operation, provider, model, error_type).observe(max(seconds, 0.0))
        if usage is not None:
            tokens = usage.otel_attributes()
            self.token_usage.labels(operation, provider, model, "input").observe(
                tokens["gen_ai.usage.input_tokens"])
            self.token_usage.labels(operation, provider, model, "output").observe(
                tokens["gen_ai.usage.output_tokens"])
