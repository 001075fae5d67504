"""Where a needle answer's recalled attention goes, per layer: the evidence behind
recalling in some layers only (kvchat/calibrate.py `recall_layers`, issue 19).

    KVCHAT_HOME=. OMP_NUM_THREADS=1 python docs/bench/recall-layers/layer_mass.py window 2048 all > layer_mass_window.txt

Five needle probes (depths 0.1-0.9, one message, budget 25%, `--recall 32`); at every
decode step of each answer, per layer: the share of the step's attention (the largest
over the layer's query heads) that went to the recalled rows, and to the rows of the
needle's sentence among them. `all`: every layer recalls (what the choice is measured
against); `chosen`: the layers the calibration picked. Prints each answer, then a line
per layer (layers that did not recall print nothing).
"""

import random
import sys

import torch

from kvchat import layer as layer_module
from kvchat import recall as recall_module
from kvchat.bench import recall as bench
from kvchat.engine import load_engine
from kvchat.realkv import essays_text
from kvchat.settings import CacheSettings, ModelOptions, SamplingSettings
from kvchat.turns import user_message

torch.set_num_threads(1)
method, context, which = sys.argv[1], int(sys.argv[2]), sys.argv[3]
engine = load_engine(ModelOptions(threads=1))
chosen = engine.measured("recall_layers")
if which == "all":
    engine._measured["recall_layers"] = list(range(engine.loaded.num_layers))
print("recalling layers:", engine._measured["recall_layers"])

# Observation only: keep each tier's last recall, and measure after the layer attends.
plain_recall = recall_module.RecallTier._recall


def keep_last(self, query, middle):
    self.last_recalled = plain_recall(self, query, middle)
    return self.last_recalled


recall_module.RecallTier._recall = keep_last
plain_attend = layer_module.CompressedLayer.attend
stats: dict[int, list[float]] = {}
state = {"fact": torch.zeros(0, dtype=torch.long), "on": False}


def attend_and_measure(self, query, scale, new_tokens):
    out = plain_attend(self, query, scale, new_tokens)
    rec = getattr(self.recall, "last_recalled", None) if self.recalls else None
    if state["on"] and new_tokens == 1 and rec is not None:
        h = self.spec.num_kv_heads
        q = query.float().reshape(h, -1, query.shape[-1]) * scale
        m = self.middle
        hot = q @ torch.cat([self.sink_keys, m.keys, self.window.keys], 1).float().transpose(1, 2)
        if m.length:
            s = self.sink_keys.shape[1]
            hot[..., s : s + m.length] += rec.middle_num[:, None, :].float()
        cold = q @ rec.keys.float().transpose(1, 2)
        if rec.weights is not None:
            cold[..., : rec.weights.shape[1]] += rec.weights[:, None, :]
        probs = torch.softmax(torch.cat([cold, hot], -1), -1)[..., : cold.shape[-1]]
        chosen_rows = rec.rows.shape[1]
        fact = torch.isin(rec.rows + self.recall.index.first, state["fact"])  # [H, r]
        entry = stats.setdefault(self.spec.layer, [0.0, 0.0, 0])
        entry[0] += float(probs.sum(-1).max())
        entry[1] += float((probs[..., :chosen_rows] * fact[:, None, :]).sum(-1).max())
        entry[2] += 1
    return out


layer_module.CompressedLayer.attend = attend_and_measure
rng = random.Random(0)
haystack = essays_text()
right = 0
for depth in (0.1, 0.3, 0.5, 0.7, 0.9):
    probe = bench.needle_probe(engine, haystack, context, depth, rng.randrange(10000, 100000))
    session = engine.new_session(CacheSettings(method=method, budget="25%", recall=32))
    logits = session.prefill_message(user_message(probe.question, probe.document))
    state["fact"], state["on"] = bench.fact_positions(engine, session, probe.fact), True
    answer = session.reply(logits, SamplingSettings(max_new_tokens=12)).text
    state["on"] = False
    right += bench.is_correct(answer, probe.answer)
    print(depth, repr(answer), probe.answer, flush=True)
print(f"correct {right} of 5")
for layer in sorted(stats):
    recalled, fact, steps = stats[layer]
    print(f"layer {layer:2d} recalled {recalled / steps:.3f} needle {fact / steps:.3f}")
