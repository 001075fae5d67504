"""Screens: the chat (main) screen and the modal screens opened from it."""

from kvchat.tui.screens.branch import BranchChoice, BranchPicker, EditMessage
from kvchat.tui.screens.chat import ChatScreen
from kvchat.tui.screens.compare import CompareMethodsPicker, CompareScreen
from kvchat.tui.screens.dialogs import ConfirmDialog, TextPrompt
from kvchat.tui.screens.help import HelpScreen
from kvchat.tui.screens.memory import MemoryScreen
from kvchat.tui.screens.method_picker import MethodPicker
from kvchat.tui.screens.sessions import SessionsScreen

__all__ = [
    "BranchChoice",
    "BranchPicker",
    "ChatScreen",
    "CompareMethodsPicker",
    "CompareScreen",
    "ConfirmDialog",
    "EditMessage",
    "HelpScreen",
    "MemoryScreen",
    "MethodPicker",
    "SessionsScreen",
    "TextPrompt",
]
