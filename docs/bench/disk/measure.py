"""Giving disk back after a delete: incremental auto-vacuum against a plain VACUUM.

    python docs/bench/disk/measure.py [--sessions 3] [--tokens 28000] [--folder DIR]

Builds sessions databases with the store's own APIs: each session one turn whose recall
tier holds `--tokens` cold rows of random bf16 in the embedded model's 14 retrieval
layers (3 KV heads of 64: 10.75 KB a token, about 300 MB at 28,000 tokens) and a 4 MB
snapshot. Then, for each mode (the file in incremental auto-vacuum, as a new kvchat
database is; the file without auto-vacuum, as one made before migration m006), it times:
the save of a session; deleting the oldest session (its pages at the start of the file:
every later page moves) and the newest (at the end), each followed by what gives the
space back (`PRAGMA incremental_vacuum` and a WAL checkpoint, or a plain `VACUUM`);
`list_sessions` with its sizes; and the one-off switch of an old file (the VACUUM of
migration m006, at its first open). File sizes are the main file's, after a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import tempfile
import time
from pathlib import Path

import torch

from kvchat.storage import disk
from kvchat.storage.db import Store

LAYERS, HEADS, DIM = 14, 3, 64


def cold_rows(tokens: int, seed: int) -> list[list[tuple[str, int, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        [(f"file-{seed}-{layer}", 0, torch.randn(tokens, 2, HEADS, DIM, generator=gen).bfloat16())]
        for layer in range(LAYERS)
    ]


def snapshot_layers(seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed + 1000)
    return [{"k": torch.randn(75_000, generator=gen)} for _ in range(LAYERS)]  # 4.2 MB in all


def size_mb(path: Path) -> float:
    return round(path.stat().st_size / 1e6, 1)


def build(path: Path, sessions: int, tokens: int, incremental: bool) -> tuple[Store, list[int], list[float]]:
    """A database of `sessions` sessions; returns the open store, their ids (oldest first)
    and the seconds each save took."""
    if not incremental:  # a file as kvchat made it before migration m006: no auto-vacuum
        with sqlite3.connect(path) as conn:
            conn.execute("PRAGMA auto_vacuum = NONE")
            conn.execute("PRAGMA journal_mode = WAL")
    real = disk.use_incremental_vacuum
    if not incremental:
        disk.use_incremental_vacuum = lambda conn, announce=None: False  # type: ignore[assignment]  # keep the old mode
    store = Store(path)
    ids, saves = [], []
    for n in range(sessions):
        sid = store.create_session(f"session {n}", "fp", "h2o", {})
        rows, layers = cold_rows(tokens, n), snapshot_layers(n)
        start = time.perf_counter()
        store.save_turn(
            sid, [{"role": "user", "text": "q", "token_ids": [1]}], 1, {"tokens_seen": tokens}, layers, cold_rows=rows
        )
        saves.append(round(time.perf_counter() - start, 2))
        ids.append(sid)
        del rows, layers
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    disk.use_incremental_vacuum = real  # type: ignore[assignment]
    return store, ids, saves


def delete(store: Store, sid: int, incremental: bool) -> tuple[float, float]:
    """Delete a session, then give its space back; the seconds of each."""
    real = disk.give_back
    disk.give_back = lambda conn: None  # type: ignore[assignment]  # timed apart, below
    start = time.perf_counter()
    try:
        store.delete_session(sid)
    finally:
        disk.give_back = real  # type: ignore[assignment]
    deleted = time.perf_counter()
    if incremental:
        disk.give_back(store.db.conn)
    else:
        store.db.conn.execute("PRAGMA auto_vacuum = NONE")  # the VACUUM must not switch the mode
        store.db.conn.execute("VACUUM")
        store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    return round(deleted - start, 2), round(time.perf_counter() - deleted, 2)


def run(folder: Path, sessions: int, tokens: int) -> dict:
    out: dict = {"sessions": sessions, "tokens": tokens}
    for incremental in (True, False):
        mode = "incremental" if incremental else "none"
        for which in ("oldest", "newest"):
            path = folder / f"{mode}-{which}.db"
            store, ids, saves = build(path, sessions, tokens, incremental)
            listed = time.perf_counter()
            rows = store.list_sessions()
            listed = round(time.perf_counter() - listed, 4)
            before = size_mb(path)
            deleted, given = delete(store, ids[0] if which == "oldest" else ids[-1], incremental)
            after = size_mb(path)
            out[f"{mode}/{which}"] = {
                "saves_s": saves,
                "list_s": listed,
                "session_mb": [round(r.disk_bytes / 1e6, 1) for r in rows],
                "file_mb_before": before,
                "delete_s": deleted,
                "give_back_s": given,
                "file_mb_after": after,
            }
            store.close()
            if not incremental and which == "oldest":  # the rest as an old file: its first open switches it
                start = time.perf_counter()
                Store(path).close()
                out["none/switch_at_open"] = {
                    "file_mb": after,
                    "open_s": round(time.perf_counter() - start, 2),
                    "file_mb_after": size_mb(path),
                }
            for suffix in ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)
            print(json.dumps({k: v for k, v in out.items() if k.startswith(f"{mode}/{which}")}), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=28_000)
    parser.add_argument("--folder", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        result = run(Path(folder), args.sessions, args.tokens)
    print(json.dumps(result, indent=1))
    print(f"sqlite {sqlite3.sqlite_version}, {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
