"""The tests' provider server: the development package's :mod:`dsh_dev.chaos.provider_server`.

A local HTTP server speaking the OpenAI/DeepSeek streaming ``/chat/completions`` protocol,
scripted per test (see that module). Kept as a module of its own so tests import it as
``from llm_server import ...``.
"""

from dsh_dev.chaos.provider_server import (
    LLMTestServer,
    RateLimits,
    RecordedRequest,
    ScriptedResponse,
    SSEEvent,
    chat_chunk,
    error_body,
    tool_call_part,
)

__all__ = ["LLMTestServer", "RateLimits", "RecordedRequest", "SSEEvent", "ScriptedResponse",
           "chat_chunk", "error_body", "tool_call_part"]
