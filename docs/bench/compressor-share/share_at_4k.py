"""compress_share of the real decode path (the speed bench's `_ours`) for a 4k-token
document: the cache is then 4 sinks + 1,024 middle + 1,024 window, as at 8k, and the
flush overflows the budget by more than the budget (farthest-first for subgen), but the
prefill costs half. 128 decode steps (two eviction batches).

    KVCHAT_HOME=... PYTHONPATH=<source tree> python docs/bench/compressor-share/share_at_4k.py subgen 4096
"""

import sys

import torch

from kvchat.bench.speed import _ours, _prompt_ids
from kvchat.engine import Engine
from kvchat.models import load_model
from kvchat.settings import CacheSettings

engine = Engine(load_model(device="cpu", dtype="auto"))
print("threads", torch.get_num_threads(), flush=True)
ids = _prompt_ids(engine, int(sys.argv[2]) if len(sys.argv) > 2 else 4096)
for method in sys.argv[1].split(","):
    r = _ours(engine, ids, CacheSettings(method=method, budget="1024"), new_tokens=128)
    print(method, {k: round(r[k], 4) for k in ("ttft_s", "decode_tok_s", "compress_share")}, flush=True)
