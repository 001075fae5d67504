"""Widgets of the chat screen. They never call the model: they show what they are
given and report what the user did with Messages."""

from kvchat.tui.widgets.chat_input import ChatInput, DocumentChip, PromptArea
from kvchat.tui.widgets.compare import AnswerFigures, CompareColumn
from kvchat.tui.widgets.messages import AssistantMessage, MessageList, NoticeMessage, UserMessage
from kvchat.tui.widgets.status_bar import StatusBar

__all__ = [
    "AnswerFigures",
    "AssistantMessage",
    "ChatInput",
    "CompareColumn",
    "DocumentChip",
    "MessageList",
    "NoticeMessage",
    "PromptArea",
    "StatusBar",
    "UserMessage",
]
