"""Where the needle's block ranks under several block-scoring rules, per layer.

    [FRAME=at-1024] python docs/bench/recall-layout/rank_rules.py /tmp/scores_65536_0.5.pt ...

Reads `block_scores.py`'s captures, or `rank_frames.py`'s scores in the frame FRAME; `max`
is kvchat's rule (`RecallTier._best_blocks`). `pin_rules.py` pins by these rules too.
"""

import math
import os
import sys

import torch

BLOCK = 16
SCALE = 1 / 8.0
FRAME = os.environ.get("FRAME", "scores")


def blocks_of(x, fill):
    rows = x.shape[-1]
    pad = -(-rows // BLOCK) * BLOCK - rows
    if pad:
        x = torch.cat([x, torch.full((*x.shape[:-1], pad), fill)], -1)
    return x.view(*x.shape[:-1], -1, BLOCK)


def standardise(s):
    return (s - s.mean(-1, keepdim=True)) / s.std(-1, keepdim=True).clamp(min=1e-6)


def rule_max(scores):  # kvchat's: rows standardised per head, best head, block max
    return blocks_of(standardise(scores).amax(0), -math.inf).amax(-1)


def rule_lse(scores):  # per head: block attention mass (log-sum-exp), standardised over blocks; best head
    per_head = torch.logsumexp(blocks_of(scores * SCALE, -math.inf), -1)
    return standardise(per_head).amax(0)


def rule_top2(scores):  # rows standardised per head, best head, mean of a block's two best
    b = blocks_of(standardise(scores).amax(0), -1e9)
    return b.topk(2, -1).values.mean(-1)


def rule_top4(scores):
    b = blocks_of(standardise(scores).amax(0), -1e9)
    return b.topk(4, -1).values.mean(-1)


def rule_lse_sum(scores):  # block mass summed over heads
    per_head = torch.logsumexp(blocks_of(scores * SCALE, -math.inf), -1)
    return standardise(per_head).sum(0)


def rule_max_sum(scores):  # rows standardised, block max per head, summed over heads
    return blocks_of(standardise(scores), -math.inf).amax(-1).sum(0)


RULES = {
    "max": rule_max,
    "lse": rule_lse,
    "top2": rule_top2,
    "top4": rule_top4,
    "lse_sum": rule_lse_sum,
    "max_sum": rule_max_sum,
}


def main(paths: list[str]) -> None:
    for path in paths:
        data = torch.load(path)
        needle = data["needle"]
        print(path, "needle tokens", int(needle.min()), int(needle.max()))
        for name, rule in RULES.items():
            ranks = []
            for _layer, entry in sorted(data["layers"].items()):
                scores, first = entry[FRAME], entry["first"]
                rows = needle - first
                rows = rows[(rows >= 0) & (rows < scores.shape[1])]
                if not rows.numel():
                    ranks.append(None)
                    continue
                block_scores = rule(scores)
                order = block_scores.argsort(descending=True)
                rank_of = torch.empty_like(order)
                rank_of[order] = torch.arange(order.numel())
                ranks.append(int(rank_of[(rows // BLOCK).unique()].min()))
            live = [r for r in ranks if r is not None]
            blocks = -(-data["layers"][next(iter(data["layers"]))][FRAME].shape[1] // BLOCK)
            print(
                f"  {name:8s} blocks {blocks}: best {min(live)}, top1 in {sum(r == 0 for r in live)} layers, "
                f"top2 in {sum(r < 2 for r in live)}, top4 in {sum(r < 4 for r in live)}; per layer {ranks}"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
