"""Screens: the chat (main) screen and the modal screens opened from it."""

from .branch import BranchChoice, BranchPicker, EditMessage
from .chat import ChatScreen
from .compare import CompareMethodsPicker, CompareScreen
from .dialogs import ConfirmDialog, TextPrompt
from .help import HelpScreen
from .memory import MemoryScreen
from .method_picker import MethodPicker
from .sessions import SessionsScreen

__all__ = [
    "BranchChoice", "BranchPicker", "ChatScreen", "CompareMethodsPicker", "CompareScreen", "ConfirmDialog",
    "EditMessage", "HelpScreen", "MemoryScreen", "MethodPicker", "SessionsScreen", "TextPrompt",
]
