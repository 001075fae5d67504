"""Which blocks a prompt's last chunk pins, rule against rule, on one prefill per needle.

    KVCHAT_HOME=... python docs/bench/recall-layout/pin_rules.py LENGTH DEPTHS NUMBERS

One needle per (depth, number) pair (comma-separated lists of equal length), asked in the
same message as `kvchat ask --file` asks it (`kvchat.bench.recall.needle_probe`),
defaults everywhere (`window`, recall 32). The prompt is fed as kvchat feeds it up to its
last chunk; the session is then copied once per rule, each copy feeds the last chunk with
its pins chosen by that rule and answers (greedy, 12 tokens). A pin rule names the layers
whose ranking pins and how a layer scores a block (`RecallTier._best_blocks`):

- `max`: a block's best row (rows standardised per head, the best head's);
- `lse`: its attention mass (per head the log-sum-exp of its rows at the attention's
  scale, standardised over the blocks, the best head's);

(`rank_rules.py`'s rules of those names)

over `all` retrieval layers, or the `topN` with the most retrieval mass
(`kvchat.calibration.calibrate.retrieval_masses`). `none` pins nothing. One JSON line
per needle and rule: the answer, whether it is right, and the tokens pinned.
"""

import functools
import json
import sys
import time
from pathlib import Path

import torch
from rank_rules import RULES as BLOCK_RULES  # (this script's folder: how each rule scores a block)

from kvchat.bench.recall import fact_positions, is_correct, needle_probe
from kvchat.calibration.calibrate import retrieval_path
from kvchat.calibration.realkv import essays_text
from kvchat.model.engine import load_engine
from kvchat.recall import tier
from kvchat.settings import PREFILL_CHUNK, CacheSettings, ModelOptions, SamplingSettings
from kvchat.turns import user_message

RULES = ("max-all", "lse-all", "max-top3", "lse-top3", "lse-top5", "none")

length = int(sys.argv[1])
depths = [float(x) for x in sys.argv[2].split(",")]
numbers = [int(x) for x in sys.argv[3].split(",")]
rules = sys.argv[4].split(",") if len(sys.argv) > 4 else list(RULES)
engine = load_engine(ModelOptions())
saved = retrieval_path(engine.loaded.fingerprint)
if not saved.exists():  # (the measurements shipped with kvchat)
    saved = Path(tier.__file__).parents[1] / "calibration" / "measured" / saved.name
masses = json.loads(saved.read_text())["masses"]
state: dict = {"rule": "max-all", "layer_of": {}}


@functools.cache
def by_mass(n: int) -> set[int]:
    return set(sorted(range(len(masses)), key=lambda i: -masses[i])[:n])


def best_blocks(self, scores):
    rule = state["rule"]
    layer = state["layer_of"].get(id(self))
    if rule == "none":
        return torch.zeros(0, dtype=torch.long)
    how, which = rule.split("-")
    if which != "all" and layer not in by_mass(int(which[3:])):
        return torch.zeros(0, dtype=torch.long)
    top = BLOCK_RULES[how](scores.float()).topk(1).indices
    tokens = (top[:, None] * tier.PIN_BLOCK + torch.arange(2 * tier.PIN_BLOCK)).flatten()
    return tokens[tokens < scores.shape[1]] + self.index.first


tier.RecallTier._best_blocks = best_blocks
haystack = essays_text()
for depth, number in zip(depths, numbers):
    probe = needle_probe(engine, haystack, length, depth, number)
    # (streaming, as kvchat reads a document this long: the last chunk too, fed alone)
    session = engine.new_session(CacheSettings(recall=32, prefill_mode="streaming"))
    ids = session.prompt_ids(user_message(probe.question, probe.document))
    cut = (len(ids) - 1) // PREFILL_CHUNK * PREFILL_CHUNK
    started = time.time()
    session.cache.expect(len(ids))
    state["rule"] = "max-all"
    session.feed(ids[:cut])
    fed = time.time() - started
    for rule in rules:
        copy = session.fork()
        state["rule"] = rule
        state["layer_of"] = {id(layer.recall): i for i, layer in enumerate(copy.cache.compressed_layers)}
        logits, _ = copy.feed(ids[cut:])
        pinned = copy.cache.pins.tokens.clone()
        answer = copy.reply(logits, SamplingSettings(max_new_tokens=12)).text
        needle = fact_positions(engine, copy, probe.fact)
        print(
            json.dumps(
                {
                    "length": length,
                    "depth": depth,
                    "number": number,
                    "rule": rule,
                    "correct": is_correct(answer, number),
                    "answer": answer,
                    "needle_pinned": int(torch.isin(needle, pinned).sum()),
                    "needle_tokens": int(needle.numel()),
                    "pinned": int(pinned.numel()),
                    "prefill_s": round(fed, 1),
                }
            ),
            flush=True,
        )
