"""``dsh-pipeline otel``: every ended turn as OpenTelemetry GenAI spans over OTLP/HTTP."""
