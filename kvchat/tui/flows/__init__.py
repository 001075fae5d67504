"""The app's workflows, one object each, owned by `KvchatApp` (composition, no mixins).

- `runner.ModelRunner`: the model worker's plumbing: loading the model, what the model
  is doing (the activity), stop and quit, the status bar's refresh, reporting back
  from worker threads.
- `turns.TurnsFlow`: what is typed in the editor: slash commands, attached documents'
  token counts, sending a message and streaming its answer.
- `files.FilesFlow`: attaching a file or folder (`/file`, a pasted path): reading it
  with progress (Esc stops), a folder's confirmation.
- `methods.MethodsFlow`: switching the compression method and rebuilding the cache.
- `sessions.SessionsFlow`: saved sessions (Ctrl+S): list, resume, rename, delete,
  rebuild a session whose snapshot does not fit; new session; reopening at start-up.
- `compare.CompareFlow`: Ctrl+G: the last question under several methods, continue
  with one.

A flow is not a DOM node: it starts its thread workers with `runner.run_thread`, which
makes them the app's, and reports back with `ModelRunner.from_worker`
(`call_from_thread`). Keys, actions and messages reach the app, which hands them on.
"""

from kvchat.tui.flows.compare import CompareFlow
from kvchat.tui.flows.files import FilesFlow
from kvchat.tui.flows.methods import MethodsFlow
from kvchat.tui.flows.runner import LOADING, NO_MODEL, ModelRunner
from kvchat.tui.flows.sessions import SessionsFlow
from kvchat.tui.flows.turns import TurnsFlow

__all__ = [
    "LOADING",
    "NO_MODEL",
    "CompareFlow",
    "FilesFlow",
    "MethodsFlow",
    "ModelRunner",
    "SessionsFlow",
    "TurnsFlow",
]
