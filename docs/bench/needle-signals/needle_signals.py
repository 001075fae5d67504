"""Does anything in the prefill mark the needle? A diagnostic behind docs/BENCHMARKS.md.

Run from the repository root: `OMP_NUM_THREADS=1 python docs/bench/needle-signals/needle_signals.py`.
For needle probes of `kvchat bench recall` (1k tokens, question in the same message), it
prints, per depth:

1. kept: for each method at 25%, the share of (layer, KV head) pairs whose cache still
   holds each of the needle's digit tokens after the exact prefill is compressed;
2. anticorrelated: how many middle keys BalanceKV's needle rule would protect (mean raw
   inner product with the 128-token block <= 0, layer 1), and whether a digit is among them;
3. question attention: the share of (layer, KV head) pairs where a digit is in the top 15%
   of the middle by the attention of the last 32 prompt queries (the question, SnapKV's
   observation window), and by all queries' summed attention (H2O's score).
"""

from __future__ import annotations

import torch

from kvchat.bench.recall import needle_probe
from kvchat.engine import Engine
from kvchat.models import load_model
from kvchat.realkv import capture_qkv, essays_text
from kvchat.settings import CacheSettings
from kvchat.turns import user_message

METHODS = ("window", "h2o", "subgen", "balancekv", "bumblebee", "chelsea")
CONTEXT, NUMBER, TOP, OBSERVED, BLOCK = 1024, 45678, 0.15, 32, 128


def digit_positions(engine: Engine, ids: list[int]) -> list[int]:
    tokens = engine.tokenizer.convert_ids_to_tokens(ids)
    magic = next(i for i, t in enumerate(tokens) if "magic" in t)
    return [i for i in range(magic, magic + 10) if tokens[i].strip("Ġ").isdigit()]


def kept_share(engine: Engine, text: str) -> dict[str, float]:
    shares = {}
    for method in METHODS:
        session = engine.new_session(CacheSettings(method=method, budget="25%", prefill_mode="exact-then-compress"))
        session.prefill_message(text)
        digits = set(digit_positions(engine, session.token_ids))
        hits = []
        for layer in session.cache._layers:
            middle = layer.middle
            alive = torch.isfinite(middle.log_num) | torch.isfinite(middle.log_den)
            exact = set(layer.win_pos.tolist()) | set(layer.sink_pos.tolist())
            for head in range(middle.positions.shape[0]):
                held = set(middle.positions[head][alive[head]].tolist()) | exact
                hits.append(len(held & digits) / len(digits))
        shares[method] = sum(hits) / len(hits)
    return shares


def signals(engine: Engine, text: str) -> tuple[str, float, float]:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    digits = digit_positions(engine, ids)
    n = len(ids)
    captured = capture_qkv(engine.model, torch.tensor([ids]))
    middle = slice(4, n - 128)
    question_hits = h2o_hits = pairs = 0
    anticorrelated = []
    for layer, (q, k, _v) in captured.items():
        heads, group = k.shape[0], q.shape[0] // k.shape[0]
        keys = k.float().repeat_interleave(group, 0)
        scale = k.shape[-1] ** -0.5
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        everyone = ((q.float() @ keys.transpose(1, 2)) * scale).masked_fill(~causal, float("-inf")).softmax(-1)
        by_question = everyone[:, n - OBSERVED :].sum(1).view(heads, group, n).sum(1)
        by_all = everyone.sum(1).view(heads, group, n).sum(1)
        for head in range(heads):
            for score, counter in ((by_question, "q"), (by_all, "a")):
                row = score[head, middle]
                cut = row.topk(int(TOP * row.numel())).values[-1]
                hit = any(score[head, i] >= cut for i in digits)
                if counter == "q":
                    question_hits += hit
                else:
                    h2o_hits += hit
            pairs += 1
        if layer == 1:
            for head in range(heads):
                block_start = digits[0] // BLOCK * BLOCK
                block = k[head, block_start : block_start + BLOCK].float()
                mean_ip = (block @ block.T).mean(-1)
                flagged = (mean_ip <= 0).nonzero().flatten() + block_start
                anticorrelated.append((int(flagged.numel()), any(i in digits for i in flagged.tolist())))
    flagged = sum(c for c, _ in anticorrelated)
    digit_flagged = any(d for _, d in anticorrelated)
    return f"{flagged} keys flagged, digit flagged: {digit_flagged}", question_hits / pairs, h2o_hits / pairs


def main() -> None:
    torch.set_num_threads(1)
    engine = Engine(load_model(None))
    haystack = essays_text()
    for depth in (0.1, 0.3, 0.5):
        probe = needle_probe(engine, haystack, CONTEXT, depth, NUMBER)
        text = user_message(probe.question, probe.document)
        kept = kept_share(engine, text)
        rule, question, h2o = signals(engine, text)
        print(f"depth {depth}: kept " + ", ".join(f"{m} {v:.2f}" for m, v in kept.items()))
        print(f"  anticorrelated (layer 1, needle's block): {rule}")
        print(f"  digit in top {TOP:.0%} of the middle: by question attention {question:.2f} of heads, "
              f"by all-query attention {h2o:.2f}")


if __name__ == "__main__":
    main()
