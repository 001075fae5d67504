"""Widgets of the chat screen. They never call the model: they show what they are
given and report what the user did with Messages."""

from .chat_input import ChatInput, DocumentChip, PromptArea
from .messages import AssistantMessage, MessageList, NoticeMessage, UserMessage
from .status_bar import StatusBar

__all__ = [
    "AssistantMessage", "ChatInput", "DocumentChip", "MessageList", "NoticeMessage",
    "PromptArea", "StatusBar", "UserMessage",
]
