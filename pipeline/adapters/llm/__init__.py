"""Model providers: DeepSeek / OpenAI-compatible streaming over httpx, and a scripted one.

Request and chunk shapes live in :mod:`pipeline.core.model`; this package turns them into
HTTP calls (or scripted answers). Only :mod:`.http_provider` imports httpx.
"""

from pipeline.adapters.llm.base import ModelProvider
from pipeline.adapters.llm.factory import PROVIDER_NAMES, provider_from_settings
from pipeline.adapters.llm.http_provider import (
    DEEPSEEK_BASE_URL,
    DeepSeekProvider,
    OpenAICompatibleProvider,
)
from pipeline.adapters.llm.openai_messages import (
    DEEPSEEK_DIALECT,
    OPENAI_DIALECT,
    ChatDialect,
    build_chat_body,
    to_openai_messages,
    to_openai_tools,
)
from pipeline.adapters.llm.scripted import (
    Script,
    ScriptedError,
    ScriptedProvider,
    ScriptedReply,
    ScriptedToolCall,
    echo_script,
    tool_loop_script,
)

__all__ = [
    "DEEPSEEK_BASE_URL",
    "DEEPSEEK_DIALECT",
    "OPENAI_DIALECT",
    "PROVIDER_NAMES",
    "ChatDialect",
    "DeepSeekProvider",
    "ModelProvider",
    "OpenAICompatibleProvider",
    "Script",
    "ScriptedError",
    "ScriptedProvider",
    "ScriptedReply",
    "ScriptedToolCall",
    "build_chat_body",
    "echo_script",
    "provider_from_settings",
    "to_openai_messages",
    "to_openai_tools",
    "tool_loop_script",
]
