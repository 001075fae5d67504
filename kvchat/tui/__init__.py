"""The Textual app of kvchat: chat view, method switching, sessions.

The UI sees strings, numbers and dicts only: it talks to `kvchat.engine`,
`kvchat.persist` and `kvchat.store`, never to tensors. Entry point: `app.run_app`.
"""
