"""Chat models, messages, prompts, tools, providers, the built-in chat/tool actions and ReAct.

Everything a model or tool call does goes through `ctx.durable_execute_async`, so a completed
call is never paid for (or run) twice after a crash; the transcript of an ongoing request is
in sensory memory, so it is in every checkpoint.
"""

from ratchet.agents.chat._agent import ChatAgent, TokenBudget, chat_usage, idempotency_key
from ratchet.agents.chat._embeddings import (
    EmbeddingModel,
    OllamaEmbeddingModel,
    OpenAIEmbeddingModel,
    ScriptedEmbeddingModel,
    embed,
)
from ratchet.agents.chat._errors import (
    ChatError,
    ModelCallError,
    PromptArgumentError,
    StructuredOutputError,
    TokenBudgetExceededError,
    TurnLimitError,
)
from ratchet.agents.chat._events import (
    ChatRequestEvent,
    ChatResponseEvent,
    ToolApprovalRequestEvent,
    ToolRequestEvent,
    ToolResponseEvent,
)
from ratchet.agents.chat._mcp import MCPPrompt, MCPServer, MCPTool, MCPToolError
from ratchet.agents.chat._messages import ChatMessage, MessageRole, TokenUsage, ToolCall
from ratchet.agents.chat._model import ChatModel, ChatModelSetup, ResourceDescriptor, RetryPolicy
from ratchet.agents.chat._prompt import Prompt
from ratchet.agents.chat._providers._anthropic import AnthropicChatModel
from ratchet.agents.chat._providers._ollama import OllamaChatModel
from ratchet.agents.chat._providers._openai import OpenAIChatModel
from ratchet.agents.chat._providers._scripted import ScriptedChatModel
from ratchet.agents.chat._ratelimit import RateLimit, estimate_tokens
from ratchet.agents.chat._react import ReActAgent
from ratchet.agents.chat._resources import (
    ResourceType,
    chat_model_connection,
    chat_model_setup,
    mcp_server,
    prompt,
)
from ratchet.agents.chat._tools import Tool, ToolContext, tool

# Flink Agents' names for the same things, so ported agents read naturally.
ChatModelConnection = ChatModel
OpenAIChatModelConnection = OpenAIChatModel
AnthropicChatModelConnection = AnthropicChatModel
OllamaChatModelConnection = OllamaChatModel
OpenAIChatModelSetup = ChatModelSetup
AnthropicChatModelSetup = ChatModelSetup
OllamaChatModelSetup = ChatModelSetup

__all__ = [
    "AnthropicChatModel",
    "AnthropicChatModelConnection",
    "AnthropicChatModelSetup",
    "ChatAgent",
    "ChatError",
    "ChatMessage",
    "ChatModel",
    "ChatModelConnection",
    "ChatModelSetup",
    "ChatRequestEvent",
    "ChatResponseEvent",
    "EmbeddingModel",
    "MCPPrompt",
    "MCPServer",
    "MCPTool",
    "MCPToolError",
    "MessageRole",
    "ModelCallError",
    "OllamaChatModel",
    "OllamaChatModelConnection",
    "OllamaChatModelSetup",
    "OllamaEmbeddingModel",
    "OpenAIChatModel",
    "OpenAIChatModelConnection",
    "OpenAIChatModelSetup",
    "OpenAIEmbeddingModel",
    "Prompt",
    "PromptArgumentError",
    "RateLimit",
    "ReActAgent",
    "ResourceDescriptor",
    "ResourceType",
    "RetryPolicy",
    "ScriptedChatModel",
    "ScriptedEmbeddingModel",
    "StructuredOutputError",
    "TokenBudget",
    "TokenBudgetExceededError",
    "TokenUsage",
    "Tool",
    "ToolCall",
    "ToolApprovalRequestEvent",
    "ToolContext",
    "ToolRequestEvent",
    "ToolResponseEvent",
    "TurnLimitError",
    "chat_model_connection",
    "chat_model_setup",
    "chat_usage",
    "embed",
    "estimate_tokens",
    "idempotency_key",
    "mcp_server",
    "prompt",
    "tool",
]
