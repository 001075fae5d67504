"""What a `full` session's recall tier costs: one document of `tokens` essay tokens and a
question, sent to a new `full` session with recall 32 (the default on this CPU), then
saved to a fresh database and resumed from it; `repeats` rounds. One JSON line per round:
its time to first token, cold bytes (disk), database size, first save and resume times.
Run with a kvchat tree first on PYTHONPATH to compare trees (README.md).

    KVCHAT_HOME=. PYTHONPATH=<tree> python docs/bench/full-cold/measure.py 6000 3
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from kvchat.engine import load_engine
from kvchat.realkv import essays_text
from kvchat.settings import CacheSettings, ModelOptions, SamplingSettings
from kvchat.storage import persist
from kvchat.storage.db import Store


def main(tokens: int, repeats: int) -> None:
    engine = load_engine(ModelOptions(), on_status=lambda message: None)
    ids = engine.tokenizer(essays_text(), add_special_tokens=False).input_ids[:tokens]
    text = engine.tokenizer.decode(ids) + "\n\nWhat is the first essay about?"
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(repeats):
            session = engine.new_session(CacheSettings(method="full", recall=32))
            result = session.send(text, SamplingSettings(max_new_tokens=8))
            db = Path(folder) / f"run-{repeat}.db"
            out = {"ttft_s": round(result.metrics.ttft_s, 3), "cold_mb": session.cache.cold_bytes() / 1e6}
            with Store(db) as store:
                sid = persist.new_session_row(store, session, "bench")
                out["save_s"] = round(persist.save_turn(store, sid, session, text, result), 3)
            wal = Path(f"{db}-wal")
            out["db_mb"] = round((db.stat().st_size + (wal.stat().st_size if wal.exists() else 0)) / 1e6, 1)
            with Store(db) as store:
                start = time.perf_counter()
                resumed, info = persist.resume(store, engine, sid)
                out["resume_s"] = round(time.perf_counter() - start, 3)
                assert info.note == "", info.note
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
