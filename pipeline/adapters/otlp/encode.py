"""Spans (:class:`pipeline.core.genai_trace.Span`) as an OTLP ``ExportTraceServiceRequest``.

One resource (``service.name`` = ``dsh-pipeline``), one instrumentation scope per request,
whose ``schema_url`` names the semantic conventions followed (v1.41.0). Attribute values:
str, bool, int (as int64), float, and a tuple of strings as an array.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    InstrumentationScope,
    KeyValue,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Status
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan

from pipeline.core.errors import CodecError
from pipeline.core.genai_trace import SEMCONV_SCHEMA_URL, AttrValue, Span

SCOPE_NAME: Final = "dsh-pipeline.otel"
SERVICE_NAME: Final = "dsh-pipeline"
CONTENT_TYPE: Final = "application/x-protobuf"
_KINDS: Final = {"INTERNAL": ProtoSpan.SPAN_KIND_INTERNAL, "CLIENT": ProtoSpan.SPAN_KIND_CLIENT,
                 "SERVER": ProtoSpan.SPAN_KIND_SERVER}
_NS_PER_MS: Final = 1_000_000


def any_value(value: AttrValue) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, str):
        return AnyValue(string_value=value)
    return AnyValue(array_value=ArrayValue(values=[AnyValue(string_value=v) for v in value]))


def key_values(attributes: Mapping[str, AttrValue]) -> list[KeyValue]:
    return [KeyValue(key=k, value=any_value(v)) for k, v in attributes.items()]


def proto_span(span: Span) -> ProtoSpan:
    out = ProtoSpan(
        trace_id=span.trace_id, span_id=span.span_id, parent_span_id=span.parent_span_id,
        name=span.name, kind=_KINDS[span.kind],
        start_time_unix_nano=max(span.start_ms, 0) * _NS_PER_MS,
        end_time_unix_nano=max(span.end_ms, span.start_ms, 0) * _NS_PER_MS,
        attributes=key_values(span.attributes),
        events=[ProtoSpan.Event(time_unix_nano=max(e.time_ms, 0) * _NS_PER_MS, name=e.name,
                                attributes=key_values(e.attributes)) for e in span.events])
    if span.error is not None:
        out.status.CopyFrom(Status(code=Status.STATUS_CODE_ERROR, message=span.error))
    return out


def export_request(spans: Iterable[Span], *, service_version: str = "") -> bytes:
    """The serialized ``ExportTraceServiceRequest`` of ``spans``."""
    resource = {"service.name": SERVICE_NAME}
    if service_version:
        resource["service.version"] = service_version
    request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource=Resource(attributes=key_values(resource)),
        scope_spans=[ScopeSpans(scope=InstrumentationScope(name=SCOPE_NAME),
                                schema_url=SEMCONV_SCHEMA_URL,
                                spans=[proto_span(s) for s in spans])],
        schema_url=SEMCONV_SCHEMA_URL)])
    data: bytes = request.SerializeToString()
    return data


def decode_request(body: bytes) -> ExportTraceServiceRequest:
    """A received request (for receivers and tests); a CodecError when it is not one."""
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError, among others
        raise CodecError(f"not an OTLP ExportTraceServiceRequest: {exc}") from None
    return request


def rejected_spans(body: bytes) -> tuple[int, str]:
    """(rejected span count, message) of a success response's ``partial_success``."""
    response = ExportTraceServiceResponse()
    try:
        response.ParseFromString(body)
    except Exception:
        return 0, ""
    partial = response.partial_success
    return int(partial.rejected_spans), str(partial.error_message)


def spans_of(request: ExportTraceServiceRequest) -> Sequence[ProtoSpan]:
    return [span for rs in request.resource_spans for ss in rs.scope_spans
            for span in ss.spans]
