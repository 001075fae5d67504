"""The Textual app of kvchat: chat view, method switching, sessions, compare.

The UI sees strings, numbers and dicts only: it talks to `kvchat.chat.controller` (which
owns the engine and the store), never to tensors. `app.py` holds `KvchatApp` (keys,
actions, the screens it opens) and the entry point `app.run_app`; `flows/` holds its
workflows (model worker plumbing, turns, methods, sessions, compare); `screens/` and
`widgets/` draw, and report what the user did with messages.
"""
