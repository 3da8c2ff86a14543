"""OTLP/HTTP: spans encoded with ``opentelemetry-proto`` and posted with httpx."""
