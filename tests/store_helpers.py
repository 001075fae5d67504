"""Subprocess side of tests/storage/test_store.py: a kvchat process killed mid-save, and writers
that share one database file with another process.

    python tests/store_helpers.py crash-mid-save DB SESSION LAYERS KILL_AT
    python tests/store_helpers.py crash-before-cleanup DB SESSION
    python tests/store_helpers.py crash-before-give-back DB SESSION
    python tests/store_helpers.py crash-mid-delta DB SESSION KILL_AT
    python tests/store_helpers.py crash-mid-cold DB SESSION KILL_AT
    python tests/store_helpers.py append DB SESSION COUNT TAG

The crash modes SIGKILL their own process from inside save_snapshot, so where the kill
lands is deterministic (no timing): mid-save = while encoding layer KILL_AT, after
KILL_AT layer blobs were inserted in the open transaction; mid-delta = the same, in a
delta written on the session's newest snapshot (loaded first); before-cleanup = after the
new snapshot committed, before the older one is deleted; mid-cold = while the recall
tier's new rows are appended, after KILL_AT of them went into the open transaction;
before-give-back = after a session's delete committed, before its space is given back.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

from kvchat.storage import codec, cold, disk
from kvchat.storage.db import Store

LAYER_FLOATS = 256 * 1024  # 1 MiB of float32 per layer


def big_layers(n: int) -> list[dict]:
    """n layers of 1 MiB each (random, so nothing compresses or dedups)."""
    gen = torch.Generator().manual_seed(1)
    return [{"k": torch.randn(LAYER_FLOATS, generator=gen), "i": i} for i in range(n)]


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _die_at_encode(kill_at: int) -> None:
    """From now on, the process is killed when the store encodes its `kill_at`-th layer."""
    real_encode = codec.encode_layer
    calls = 0

    def encode_then_maybe_die(layer: dict, *rest: object) -> bytes:
        nonlocal calls
        if calls == kill_at:
            _die()
        calls += 1
        return real_encode(layer, *rest)

    codec.encode_layer = encode_then_maybe_die


def crash_mid_save(db: str, session_id: int, n_layers: int, kill_at: int) -> None:
    _die_at_encode(kill_at)
    store = Store(db)
    store.save_snapshot(session_id, 2, {"tokens_seen": 2000}, big_layers(n_layers))
    raise SystemExit("save_snapshot returned; the kill did not happen")


def grown(layers: list[dict], rows: int) -> list[dict]:
    """`layers` with `rows` random rows appended to each tensor along dim 0 (what a delta stores)."""
    gen = torch.Generator().manual_seed(2)
    return [{"k": torch.cat([state["k"], torch.randn(rows, generator=gen)]), "i": state["i"]} for state in layers]


def crash_mid_delta(db: str, session_id: int, kill_at: int) -> None:
    store = Store(db)
    snap = store.load_snapshot(session_id)  # the store now knows the chain: the next save is a delta
    _die_at_encode(kill_at)
    store.save_snapshot(session_id, snap.turn + 1, {"tokens_seen": 3000}, grown(snap.layers, 4096))
    raise SystemExit("save_snapshot returned; the kill did not happen")


def cold_layers(n: int, rows: int, ident: str = "file-a") -> list[list[tuple[str, int, torch.Tensor]]]:
    """A recall tier's rows as a cache hands them to the store: per layer, one segment of
    `rows` rows [rows, 2, 3, 64] in bfloat16 from the file `ident` (random, seeded by layer)."""
    return [
        [(ident, 0, torch.randn(rows, 2, 3, 64, generator=torch.Generator().manual_seed(i)).bfloat16())]
        for i in range(n)
    ]


def crash_mid_cold(db: str, session_id: int, kill_at: int) -> None:
    store = Store(db)
    snap = store.load_snapshot(session_id)
    rows = int(snap.meta["rows"])
    store.load_cold(session_id, snap.id, lambda layer, part: None, lambda: cold_layers(4, rows))
    real_insert, calls = cold._insert, []

    def insert_then_maybe_die(*args: object) -> int:
        if len(calls) == kill_at:
            _die()
        calls.append(1)
        return real_insert(*args)

    cold._insert = insert_then_maybe_die
    store.save_turn(
        session_id, [], snap.turn + 1, {"rows": rows + 500}, snap.layers, cold_rows=cold_layers(4, rows + 500)
    )
    raise SystemExit("save_turn returned; the kill did not happen")


def crash_before_cleanup(db: str, session_id: int) -> None:
    Store._drop_older_snapshots = lambda self, sid, keep: _die()  # type: ignore[method-assign]
    store = Store(db)
    store.save_snapshot(session_id, 2, {"tokens_seen": 2000}, big_layers(2))
    raise SystemExit("save_snapshot returned; the kill did not happen")


def crash_before_give_back(db: str, session_id: int) -> None:
    disk.give_back = lambda conn: _die()  # type: ignore[assignment]
    Store(db).delete_session(session_id)
    raise SystemExit("delete_session returned; the kill did not happen")


def append(db: str, session_id: int, count: int, tag: str) -> None:
    store = Store(db, timeout_s=30)
    print("ready", flush=True)
    sys.stdin.readline()  # the test releases both writers at once
    for i in range(count):
        store.add_message(session_id, "user", f"{tag} {i}", [i], {"tag": tag})
    store.close()
    print("done", flush=True)


def main(argv: list[str]) -> None:
    mode, db, session = argv[0], argv[1], int(argv[2])
    if mode == "crash-mid-save":
        crash_mid_save(db, session, int(argv[3]), int(argv[4]))
    elif mode == "crash-mid-delta":
        crash_mid_delta(db, session, int(argv[3]))
    elif mode == "crash-mid-cold":
        crash_mid_cold(db, session, int(argv[3]))
    elif mode == "crash-before-give-back":
        crash_before_give_back(db, session)
    elif mode == "crash-before-cleanup":
        crash_before_cleanup(db, session)
    elif mode == "append":
        append(db, session, int(argv[3]), argv[4])
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
