"""Widgets of the chat screen. They never call the model: they show what they are
given and report what the user did with Messages."""

from .chat_input import ChatInput, DocumentChip, PromptArea
from .compare import AnswerFigures, CompareColumn
from .messages import AssistantMessage, MessageList, NoticeMessage, UserMessage
from .status_bar import StatusBar

__all__ = [
    "AnswerFigures", "AssistantMessage", "ChatInput", "CompareColumn", "DocumentChip", "MessageList",
    "NoticeMessage", "PromptArea", "StatusBar", "UserMessage",
]
