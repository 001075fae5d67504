"""A later turn's time to first token with and without recall, side by side: one process
loads the model, prefills an essay of CONTEXT tokens twice (recall off, recall 32), then
5 rounds take each in turn: a fork decodes 64 greedy tokens, and the bench's later-turn
question is fed and timed to its first token (`kvchat.bench.speed._after_prefill`).

    KVCHAT_HOME=/work/main .venv/bin/python docs/bench/speed-session12/later_turn.py window 2048
"""

import statistics
import sys

from kvchat.bench.speed import _after_prefill, _prefilled, _prompt_ids
from kvchat.engine import load_engine
from kvchat.settings import CacheSettings, ModelOptions

method, context = sys.argv[1], int(sys.argv[2])
engine = load_engine(ModelOptions(threads=2), on_status=lambda message: None)
ids = _prompt_ids(engine, context)
prefilled = {recall: _prefilled(engine, ids, CacheSettings(method=method, recall=recall)) for recall in (0, 32)}


def later_turn(recall: int) -> float:
    """The bench's own decode-then-later-turn (`_after_prefill`) on a fork."""
    session, token, _, _ = prefilled[recall]
    return _after_prefill(engine, session.fork(), token, 64, next_turn=True)["next_turn_ttft_s"]


times: dict[int, list[float]] = {0: [], 32: []}
for _ in range(5):
    for recall in (0, 32):
        times[recall].append(later_turn(recall))
medians = {recall: statistics.median(t) for recall, t in times.items()}
print(method, context, {r: [round(x, 3) for x in t] for r, t in times.items()},
      "medians", {r: round(m, 3) for r, m in medians.items()}, "ratio", round(medians[32] / medians[0], 2))
