"""Sessions on disk: save a turn (messages + cache snapshot), resume, rebuild.

Two calls each way. A save asks the session for its `SavedState` and hands the store a
record: plain meta + flat per-layer state dicts (`kvchat.storage.db`) and, with a recall
tier, the tier's rows (views into its files: the store writes the ones it has not saved
yet, `kvchat.storage.cold`). A resume reads the newest record from the store and hands it
to a fresh session (`ChatSession.restore`, then `restore_recall_tier`, which streams the
saved rows back): it continues at the saved position, with no prefix recomputed.
"""

from __future__ import annotations

import base64
import importlib.metadata
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from kvchat import __version__
from kvchat.errors import SnapshotMismatch, StoreError
from kvchat.model.engine import Engine
from kvchat.model.session import ChatSession, SavedState
from kvchat.settings import CacheSettings
from kvchat.storage.db import Store
from kvchat.turns import DocumentPart, ProgressFn, Span, TurnResult

FORMAT_VERSION = 1


@dataclass
class ResumeInfo:
    tokens: int
    seconds: float
    rebuilt: bool
    reason: str = ""
    note: str = ""  # what the user should know of a resume that went through (a lost recall tier)

    def describe(self) -> str:
        if self.rebuilt:
            return f"rebuilt {self.tokens:,} tokens from the transcript in {self.seconds:.1f} s ({self.reason})"
        said = f"restored {self.tokens:,} tokens from disk in {self.seconds:.1f} s"
        return f"{said}; {self.note}" if self.note else said


# Settings to and from what is saved: the one place that knows their saved form (a
# snapshot's meta["settings"] and a session row's params are both this dict). The
# session's system prompt is saved in it too, under "system", only when it has one.
def settings_meta(settings: CacheSettings, system: str | None = None) -> dict[str, Any]:
    meta = {
        "method": settings.method,
        "budget": settings.budget,
        "window": settings.window,
        "sinks": settings.sinks,
        "batch": settings.batch,
        "params": settings.params,
        "seed": settings.seed,
        "allocation": settings.allocation,
        "fit_window": settings.fit_window,
        "recall": settings.recall,
    }
    if system is not None:
        meta["system"] = system
    return meta


def session_meta(session: ChatSession) -> dict[str, Any]:
    """What is saved of a session's settings and system prompt."""
    return settings_meta(session.settings, session.system)


def system_from_meta(saved: dict[str, Any]) -> str | None:
    """The system prompt `saved` (a `settings_meta` dict) holds; None for a session
    without one, or saved before system prompts were kept."""
    system = saved.get("system")
    return system if isinstance(system, str) and system.strip() else None


def settings_from_meta(saved: dict[str, Any], base: CacheSettings | None = None) -> CacheSettings:
    """The settings `saved` (a `settings_meta` dict) describes. Keys it lacks come from
    `base` (default: the defaults): sessions saved before byte budgets have no
    allocation, session rows of old kvchat versions may lack more."""
    base = base or CacheSettings()
    return replace(
        base,
        method=str(saved.get("method", base.method)),
        budget=str(saved.get("budget", base.budget)),
        window=int(saved.get("window", base.window)),
        sinks=int(saved.get("sinks", base.sinks)),
        batch=int(saved.get("batch", base.batch)),
        params=dict(saved.get("params", base.params)),
        seed=int(saved.get("seed", base.seed)),
        allocation=str(saved.get("allocation", base.allocation)),
        # Saved before windows were fitted to byte budgets: the window was kept as given.
        fit_window=bool(saved.get("fit_window", False)),
        # Saved before the recall tier could be chosen: it was off, whatever `base` says.
        recall=int(saved.get("recall", 0)),
    )


def snapshot_meta(session: ChatSession) -> dict[str, Any]:
    """Everything besides the tensors that resuming exactly needs."""
    return _snapshot_meta(session, session.saved_state())


def _snapshot_meta(session: ChatSession, state: SavedState) -> dict[str, Any]:
    loaded = session.engine.loaded
    meta = dict(state.cache_meta)
    meta.update(
        format_version=FORMAT_VERSION,
        model_fingerprint=loaded.fingerprint,
        model=loaded.name,
        dtype=str(loaded.dtype).removeprefix("torch."),
        settings=session_meta(session),
        token_ids=state.token_ids,
        messages=state.messages,
        spans=[span.as_list() for span in state.spans or []],
        parts=[part.as_list() for part in state.parts or []],
        memory=saved_memory(session),
        rng_state=base64.b64encode(state.rng_state or b"").decode(),
        kvchat_version=__version__,
        transformers_version=importlib.metadata.version("transformers"),
    )
    return meta


def saved_memory(session: ChatSession) -> dict[str, Any]:
    """The memory map saved with a snapshot (for `kvchat sessions show --memory`): the
    report without its per-layer, per-position grid, which only the app draws, live."""
    return session.memory_report(cell_layers=False).as_dict()


def new_session_row(store: Store, session: ChatSession, title: str) -> int:
    loaded = session.engine.loaded
    return store.create_session(title, loaded.fingerprint, session.settings.method, session_meta(session))


def title_for(text: str, limit: int = 48) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def save_turn(store: Store, session_id: int, session: ChatSession, user_text: str, result: TurnResult) -> float:
    """Record a completed turn in one store call and one transaction: its messages, its
    snapshot (a delta on the previous one when the store has it) and the session row.
    Returns the seconds the save took."""
    prompt_ids = result.prompt_ids
    if session.messages and session.messages[-1]["role"] == "user":
        # Stopped during prefill: the model saw only part of the message and no answer.
        messages = [_message("user", session.messages[-1]["content"], prompt_ids, result.metrics.as_dict())]
    else:
        messages = [
            _message("user", user_text, prompt_ids),
            _message("assistant", result.text, result.token_ids, result.metrics.as_dict()),
        ]
    # A conversation saved for the first time after earlier turns (a fork, or a compare's
    # chosen answer): the messages before this turn are written too, so the saved
    # transcript is whole (their token ids are in the snapshot).
    stored = store.get_session(session_id).message_count
    earlier = session.messages[: len(session.messages) - len(messages)]
    messages = [_message(m["role"], m["content"], []) for m in earlier[stored:]] + messages
    return _save(store, session_id, session, messages)


def _message(role: str, text: str, token_ids: list[int], metrics: dict | None = None) -> dict[str, Any]:
    return {"role": role, "text": text, "token_ids": list(token_ids), "metrics": metrics or {}}


def save_snapshot(store: Store, session_id: int, session: ChatSession, rebuilt: bool = False) -> float:
    """Save the cache (and the session's method, params and system prompt) without new
    messages; seconds taken. `rebuilt`: the cache was read again from the transcript."""
    return _save(store, session_id, session, [], rebuilt)


def _save(
    store: Store, session_id: int, session: ChatSession, messages: list[dict[str, Any]], rebuilt: bool = False
) -> float:
    start = time.perf_counter()
    turn = sum(1 for m in session.messages if m["role"] == "user")
    changes = {"method": session.settings.method, "params": session_meta(session)}
    state = session.saved_state()
    meta = _snapshot_meta(session, state)
    store.save_turn(session_id, messages, turn, meta, state.layers, changes, state.cold_rows, whole_tier=rebuilt)
    session.release_memory()  # the copy read the new cold rows through their files' mappings
    return time.perf_counter() - start


def check_compatible(meta: dict[str, Any], engine: Engine) -> None:
    loaded = engine.loaded
    if meta.get("format_version") != FORMAT_VERSION:
        raise SnapshotMismatch(
            f"the snapshot format is {meta.get('format_version')}, this kvchat reads {FORMAT_VERSION}"
        )
    if meta.get("model_fingerprint") != loaded.fingerprint:
        raise SnapshotMismatch(
            f"the snapshot was made with another model ({meta.get('model', '?')}, "
            f"fingerprint {meta.get('model_fingerprint')}; loaded: {loaded.name}, {loaded.fingerprint})"
        )
    dtype = str(loaded.dtype).removeprefix("torch.")
    if meta.get("dtype") != dtype:
        raise SnapshotMismatch(f"the snapshot holds {meta.get('dtype')} tensors, the model runs in {dtype}")


def resume(store: Store, engine: Engine, session_id: int) -> tuple[ChatSession, ResumeInfo]:
    """Load the newest snapshot into a fresh cache. Raises SnapshotMismatch when the
    snapshot does not fit the loaded model (the caller offers `rebuild`)."""
    start = time.perf_counter()
    row = store.get_session(session_id)  # a clear error for an unknown id
    snap = store.load_snapshot(session_id)
    if snap is None:
        raise SnapshotMismatch("the session has no saved cache yet")
    meta = snap.meta
    check_compatible(meta, engine)
    session = ChatSession(engine, settings_from_meta(meta["settings"]), system=system_from_meta(meta["settings"]))
    spans = (
        [Span(int(a), int(b), str(role), int(msg)) for a, b, role, msg in meta["spans"]] if "spans" in meta else None
    )
    parts = [  # (none: saved before pages were kept)
        DocumentPart(int(a), int(b), str(document), str(part), int(msg))
        for a, b, document, part, msg in meta.get("parts", [])
    ]
    try:
        session.restore(
            SavedState(  # no spans: saved before they were kept
                cache_meta=meta,
                layers=snap.layers,
                token_ids=meta["token_ids"],
                messages=meta["messages"],
                spans=spans,
                rng_state=base64.b64decode(meta["rng_state"]),
                parts=parts,
            )
        )
    except (KeyError, ValueError, RuntimeError) as err:
        raise SnapshotMismatch(f"the snapshot does not fit this cache ({err})") from None
    note = restore_cold(store, session_id, snap.id, session, dropped=row.tier_dropped is not None)
    return session, ResumeInfo(session.tokens_seen, time.perf_counter() - start, rebuilt=False, note=note)


def restore_cold(store: Store, session_id: int, snapshot_id: int, session: ChatSession, dropped: bool = False) -> str:
    """Stream the saved recall tier of snapshot `snapshot_id` into the resumed session. A
    tier that cannot be read back (rows missing or damaged, or not the ones the snapshot
    names; `dropped`: the disk budget dropped them) is not worth refusing the session
    for: it resumes with an empty tier, which fills again as tokens leave the window, as
    a snapshot without a tier does. Returns what to tell the user then ("" when all
    went well)."""
    lost = "its recall tier starts empty"
    try:
        whole = session.restore_recall_tier(
            lambda sink, expected: store.load_cold(session_id, snapshot_id, sink, expected)
        )
    except (StoreError, ValueError) as err:
        return f"{lost}: {err}"
    if whole is not False:
        return ""
    if dropped:
        return f"{lost}: the disk budget dropped it (a rebuild reads it again from the transcript)"
    return f"{lost}: its saved rows are not the ones its snapshot names"


def rebuild(
    store: Store,
    engine: Engine,
    session_id: int,
    settings: CacheSettings,
    reason: str = "",
    on_progress: ProgressFn | None = None,
    cancel: threading.Event | None = None,
) -> tuple[ChatSession, ResumeInfo]:
    """Re-prefill a saved conversation through `settings` on the loaded model: the
    stored transcript, after the session's saved system prompt, is rendered with this
    model's chat template (token ids from another model would mean nothing), then fed
    in chunks with progress."""
    start = time.perf_counter()
    session = ChatSession(engine, settings, system=system_from_meta(store.get_session(session_id).params))
    session.read_transcript(
        [{"role": r.role, "content": r.text} for r in store.messages(session_id)], on_progress, cancel
    )
    save_snapshot(store, session_id, session, rebuilt=True)
    return session, ResumeInfo(session.tokens_seen, time.perf_counter() - start, rebuilt=True, reason=reason)
