"""Greedy tokens of one conversation under every method, for checking that a redesign
changes no behaviour (issue 18): run it on the commit before and after, then diff the JSON.

    python docs/bench/redesign/greedy_tokens.py OUT.json

Each method (and each non-default mode in the method matrix) answers three turns on the
embedded model in float32: a question about a ~1,500-token essay excerpt, then two short
follow-ups, with a window of 128 and a budget of 25% so that every method compresses.
The third turn runs in a session resumed from a real SQLite snapshot written after the
second, so the save/resume path is covered too.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from kvchat import compress
from kvchat.engine import Engine
from kvchat.models import load_model
from kvchat.realkv import essays_text
from kvchat.settings import CacheSettings, SamplingSettings

try:  # after the redesign
    from kvchat.turns import user_message
except ImportError:  # before it (554d277)
    from kvchat.engine import ChatSession

    user_message = ChatSession.user_message

VARIANTS = [(m, {}) for m in compress.available()] + [
    ("subgen", {"mode": "stream"}),
    ("subgen", {"kcenter_weights": "size"}),
    ("balancekv", {"schedule": "prefill"}),
]
QUESTIONS = ["What is the essay above about?", "Name one example it gives.", "Say it in one sentence."]


def saved_and_resumed(engine, session, db: Path):
    """Save the session through the store and load it back (the API moved in the redesign)."""
    try:
        from kvchat.storage import persist
        from kvchat.storage.db import Store
    except ImportError:
        from kvchat.store import Store

        from kvchat import persist
    store = Store(db)
    try:
        sid = persist.new_session_row(store, session, "greedy")
        persist.save_snapshot(store, sid, session)
        resumed, _ = persist.resume(store, engine, sid)
    finally:
        store.close()
    return resumed


def main(out: str) -> None:
    engine = Engine(load_model(device="cpu", dtype="float32"))
    document = essays_text()[:6000]
    sampling = SamplingSettings(max_new_tokens=24)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (method, params) in enumerate(VARIANTS):
            name = method + "".join(f":{v}" for v in params.values())
            settings = CacheSettings(method=method, budget="25%", window=128, sinks=4, params=dict(params))
            session = engine.new_session(settings)
            tokens = [session.send(user_message(QUESTIONS[0], document), sampling, document=document).token_ids]
            tokens.append(session.send(QUESTIONS[1], sampling).token_ids)
            session = saved_and_resumed(engine, session, Path(tmp) / f"{i}.db")
            tokens.append(session.send(QUESTIONS[2], sampling).token_ids)
            results[name] = {"tokens": tokens, "kv_bytes": int(session.stats()["kv_bytes"])}
            print(name, [len(t) for t in tokens], results[name]["kv_bytes"], flush=True)
    Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
