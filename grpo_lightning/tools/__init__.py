"""Tools for agent training: JSON schemas from signatures and docstrings, tool-call parsers by model
family, execution with timeouts, and the chat-template rendering of tool turns.

Layer L1: pure python, no lightning.
"""

from grpo_lightning.tools.execution import ToolResult, execute_calls
from grpo_lightning.tools.parsers import (
    PARSERS, AssistantTurn, DeepSeekV3ToolCallParser, HermesToolCallParser, Qwen3ToolCallParser, ToolCall, ToolCallParser, detect_family,
    get_parser,
)
from grpo_lightning.tools.schema import ToolSchemaError, tool_schema
from grpo_lightning.tools.templates import TEMPLATE_FIXES, TemplateError, ToolTurnTemplate, training_chat_template
from grpo_lightning.tools.toolbox import Tool, Toolbox

__all__ = [
    "PARSERS", "TEMPLATE_FIXES", "AssistantTurn", "DeepSeekV3ToolCallParser", "HermesToolCallParser", "Qwen3ToolCallParser", "TemplateError",
    "Tool", "ToolCall", "ToolCallParser", "ToolResult", "ToolSchemaError", "ToolTurnTemplate", "Toolbox",
    "detect_family", "execute_calls", "get_parser", "tool_schema", "training_chat_template",
]  # fmt: skip
