"""Screens: the chat (main) screen and the modal screens opened from it."""

from .chat import ChatScreen
from .compare import CompareMethodsPicker, CompareScreen
from .dialogs import ConfirmDialog, TextPrompt
from .help import HelpScreen
from .memory import MemoryScreen
from .method_picker import MethodPicker
from .sessions import SessionsScreen

__all__ = [
    "ChatScreen", "CompareMethodsPicker", "CompareScreen", "ConfirmDialog", "HelpScreen", "MemoryScreen",
    "MethodPicker", "SessionsScreen", "TextPrompt",
]
