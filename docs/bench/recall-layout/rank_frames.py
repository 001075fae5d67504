"""Row scores at the prompt's last chunk in several frames of position, and where the needle is.

    KVCHAT_HOME=... python docs/bench/recall-layout/rank_frames.py LENGTH DEPTHS [NUMBERS]

`measure.py`'s needles (one per depth, comma-separated; NUMBERS, comma-separated, the
numbers planted instead). As kvchat runs them, each retrieval layer's chunk queries score
every cold row in these frames, saved with the needle's tokens in
/tmp/frames_{LENGTH}_{DEPTH}.pt for `rank_rules.py FRAME`:

- `index`: the 4-bit index, the keys at the positions their tokens sit at now (kvchat's);
- `now`: the stored keys, exact but for their 8-bit codes, at those positions;
- `at-W`: every key at distance W from each query row (InfLLM's frame: a key laid out at
  one fixed distance; the query turned by W less its own position, against the keys as
  the store keeps them, before RoPE);
- `now-slow`, `at-W-slow`: the same on the channels the index keeps (`ranking_channels`).
"""

import json
import sys
import time

import torch

from kvchat.bench.recall import fact_positions, is_correct, needle_probe
from kvchat.cache.layer import CompressedLayer
from kvchat.calibration.realkv import essays_text
from kvchat.kv_types import rerotate
from kvchat.model.engine import load_engine
from kvchat.recall import tier
from kvchat.recall.key_index import ranking_channels
from kvchat.settings import CacheSettings, ModelOptions, SamplingSettings
from kvchat.turns import user_message

DISTANCES = (0, 256, 1024, 2048, 4096)

length = int(sys.argv[1])
depths = [float(x) for x in sys.argv[2].split(",")]
numbers = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [40000 + int(d * 1000) for d in depths]
engine = load_engine(ModelOptions())
chunk: dict = {}  # tier id -> (ranking query [H, n, d], its rows' positions [n], index scores)
positions: dict = {}  # tier id -> this pass's query positions [L]

attend = CompressedLayer.attend


def attend_hook(self, query, scale, new_tokens):
    if self.recall is not None and new_tokens > 1:
        positions[id(self.recall)] = self.window.pos[-new_tokens:].clone()
    return attend(self, query, scale, new_tokens)


best_blocks = tier.RecallTier._best_blocks
choose = tier.RecallTier._choose


def choose_hook(self, query, middle, engine_threads):
    if query.shape[1] > 1 and id(self) in positions:
        at = positions[id(self)].to(torch.float64)
        if query.shape[1] > tier.CHUNK_QUERIES:
            at = at[tier.chunk_queries(query.shape[1], query.device)]
        group = query.shape[0] // self.heads
        chunk[id(self)] = [self._ranking_query(query).float().clone(), at.repeat(group), None]
    return choose(self, query, middle, engine_threads)


def blocks_hook(self, scores):
    if id(self) in chunk:
        chunk[id(self)][2] = scores.detach().float().cpu().clone()
    return best_blocks(self, scores)


CompressedLayer.attend = attend_hook
tier.RecallTier._choose = choose_hook
tier.RecallTier._best_blocks = blocks_hook


def frames(recall: tier.RecallTier, query, at, index_scores) -> dict:
    rows = torch.arange(index_scores.shape[1]).expand(recall.heads, -1)  # the rows the chunk ranked
    keys, _values = recall.store.read(rows)  # before RoPE
    keys = keys.float()
    out = {"index": index_scores, "first": recall.index.first}
    now = recall._turned(keys, recall._row_positions(rows))
    slow = ranking_channels(recall.inv_freq)
    out["now"] = torch.bmm(query, now.float().transpose(1, 2)).amax(1)
    out["now-slow"] = torch.bmm(query[..., slow], now.float()[..., slow].transpose(1, 2)).amax(1)
    for distance in DISTANCES:
        turned = rerotate(query, (distance - at).expand(query.shape[0], -1), recall.inv_freq)
        out[f"at-{distance}"] = torch.bmm(turned, keys.transpose(1, 2)).amax(1)
        out[f"at-{distance}-slow"] = torch.bmm(turned[..., slow], keys[..., slow].transpose(1, 2)).amax(1)
    return out


haystack = essays_text()
for depth, number in zip(depths, numbers):
    probe = needle_probe(engine, haystack, length, depth, number)
    session = engine.new_session(CacheSettings(recall=32))
    chunk.clear()
    positions.clear()
    started = time.time()
    answer = session.send(user_message(probe.question, probe.document), SamplingSettings(max_new_tokens=12)).text
    needle = fact_positions(engine, session, probe.fact)
    layers = {}
    with torch.inference_mode():
        for i, layer in enumerate(session.cache.compressed_layers):
            if layer.recall is not None and id(layer.recall) in chunk:
                query, at, index_scores = chunk[id(layer.recall)]
                layers[i] = frames(layer.recall, query, at, index_scores)
    torch.save({"needle": needle, "layers": layers}, f"/tmp/frames_{length}_{depth}.pt")
    print(
        json.dumps(
            {
                "length": length,
                "depth": depth,
                "number": number,
                "correct": is_correct(answer, probe.answer),
                "answer": answer,
                "needle": [int(needle.min()), int(needle.max())],
                "seconds": round(time.time() - started, 1),
            }
        ),
        flush=True,
    )
