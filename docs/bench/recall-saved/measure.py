"""What saving the recall tier with a session costs (kvchat/storage/cold.py), on the
embedded model's fast path (int8 weights, bf16 KV), method h2o, window 128, recall 32:
a chat of one document (~2k or ~6k tokens) saved, a fork of it answering one more turn
saved as a delta, then resumed from a fresh Store. Each size is prefilled once with recall
32 and once with recall off, and saved and resumed `--repeats` times on fresh databases;
every round goes to stderr as it ends, the medians to stdout as JSON.

Also: the KeyIndex rebuilt from the saved keys against the same index saved as a blob
and read back (the two ways to restore it), and the rows written to a plain file
instead of SQLite (what option (b), a file beside the database, would pay).

    OMP_NUM_THREADS=2 .venv/bin/python docs/bench/recall-saved/measure.py --sizes 2000 6000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import safetensors.torch
import torch

from kvchat.engine import Engine
from kvchat.models import load_model
from kvchat.realkv import essays_text
from kvchat.settings import CacheSettings, SamplingSettings
from kvchat.storage import persist
from kvchat.storage.db import Store


def document(engine: Engine, tokens: int) -> str:
    ids = engine.tokenizer(essays_text()[: tokens * 6], add_special_tokens=False).input_ids[:tokens]
    return engine.tokenizer.decode(ids)


def one_size(engine: Engine, folder: Path, tokens: int, recall: int, repeats: int) -> list[dict[str, float]]:
    """One prefill of the document, then `repeats` rounds on fresh databases: the first
    save (every row), a fork of it answering one more turn saved as a delta, and a resume
    from a fresh Store."""
    settings = CacheSettings(method="h2o", window=128, recall=recall, prefill_mode="streaming")
    session = engine.new_session(settings)
    text = document(engine, tokens) + "\n\nWhat is this about?"
    first = session.send(text, SamplingSettings(max_new_tokens=8))
    question = "And what did the author do next? Answer in two sentences."
    runs = []
    for repeat in range(repeats):
        db = folder / f"run-{tokens}-{recall}-{repeat}.db"
        out: dict[str, float] = {"tokens": session.cache.tokens_seen,
                                 "cold_rows": max(layer.recall.rows for layer in session.cache._layers) if recall else 0}
        with Store(db) as store:
            sid = persist.new_session_row(store, session, "bench")
            out["save_first_s"] = persist.save_turn(store, sid, session, text, first)
            turn = session.fork()
            result = turn.send(question, SamplingSettings(max_new_tokens=32))
            out["save_turn_s"] = persist.save_turn(store, sid, turn, question, result)
            out["cold_bytes"] = turn.cache.cold_bytes()
            out["kv_bytes"] = turn.cache.nbytes()
        wal = Path(f"{db}-wal")
        out["db_mb"] = (db.stat().st_size + (wal.stat().st_size if wal.exists() else 0)) / 1e6
        with Store(db) as store:
            start = time.perf_counter()
            resumed, info = persist.resume(store, engine, sid)
            out["resume_s"] = time.perf_counter() - start
            assert info.note == "", info.note
            if recall:
                out |= index_costs(resumed.cache, folder)
                # The cold rows alone: read back, copied into the tier's file, index rebuilt.
                snap = store.load_snapshot(sid)
                again = engine.new_session(settings).cache
                again.load_layer_states(snap.meta, snap.layers)
                start = time.perf_counter()
                again.load_cold(lambda sink: store.load_cold(sid, snap.id, sink, again.cold_rows))  # noqa: B023
                out["cold_restore_s"] = time.perf_counter() - start
                out |= file_costs(resumed.cache, folder)
        db.unlink()
        print(json.dumps({f"{tokens}/{recall}": out}), file=sys.stderr, flush=True)
        runs.append(out)
    return runs


def index_costs(cache, folder: Path) -> dict[str, float]:
    """Every layer's index rebuilt from its keys (what a resume does), against the same
    index saved as one safetensors blob per layer in SQLite and read back."""
    from kvchat.keyindex import key_index
    from kvchat.recall import REWRITE_ROWS

    tiers = [layer.recall for layer in cache._layers]
    start = time.perf_counter()
    for tier in tiers:
        index = key_index(tier.heads, tier.head_dim, tier.device, tier.channels)
        for _ident, first, rows in tier.segments():
            for at in range(0, rows.shape[0], REWRITE_ROWS):
                keys = rows[at : at + REWRITE_ROWS, 0].transpose(0, 1)
                index.append(keys, torch.arange(first + at, first + at + keys.shape[1]))
    rebuild = time.perf_counter() - start
    db = sqlite3.connect(folder / "index.db")
    db.execute("CREATE TABLE t (layer INTEGER PRIMARY KEY, blob BLOB)")
    start = time.perf_counter()
    with db:
        for i, tier in enumerate(tiers):
            # Every tensor the index holds (its layout: kvchat/keyindex.py).
            blob = safetensors.torch.save({name: value.contiguous() for name, value in vars(tier.index).items()
                                           if isinstance(value, torch.Tensor) and name != "channels"})
            db.execute("INSERT INTO t VALUES (?, ?)", [i, blob])
    save = time.perf_counter() - start
    start = time.perf_counter()
    for (blob,) in db.execute("SELECT blob FROM t ORDER BY layer"):
        safetensors.torch.load(blob)
    load = time.perf_counter() - start
    size = db.execute("SELECT sum(length(blob)) FROM t").fetchone()[0]
    db.close()
    (folder / "index.db").unlink()
    return {"index_rebuild_s": rebuild, "index_saved_write_s": save, "index_saved_read_s": load,
            "index_saved_mb": size / 1e6}


def file_costs(cache, folder: Path) -> dict[str, float]:
    """Option (b): the same rows appended to a plain file (fsync'd) and read back."""
    path = folder / "cold.kv"
    start = time.perf_counter()
    with open(path, "wb") as f:
        for layer in cache._layers:
            for _ident, _start, rows in layer.recall.segments():
                f.write(rows.view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    write = time.perf_counter() - start
    start = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass
    read = time.perf_counter() - start
    path.unlink()
    return {"file_write_s": write, "file_read_s": read}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 6000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    engine = Engine(load_model(device="cpu", dtype="int8"))
    runs: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in args.sizes:
            for recall in (32, 0):
                runs[f"{tokens}/{recall}"] = one_size(engine, Path(tmp), tokens, recall, args.repeats)
    medians = {key: {k: round(statistics.median(r[k] for r in rs), 4) for k in rs[0]} for key, rs in runs.items()}
    print(json.dumps(medians, indent=1))


if __name__ == "__main__":
    main()
