"""Capture real post-RoPE q/k/v of the embedded model on 8,063 essay tokens (the speed
bench's 8k document), layers 1, 8, 15, 28, stored in bf16 (the fast path's dtype).

Run from the repository root: `python docs/bench/compressor-share/capture_qkv.py OUT.pt`.
"""

import sys

import torch

from kvchat.models import load_model
from kvchat.realkv import capture_qkv, essays_text

model = load_model(device="cpu", dtype="float32")
ids = model.tokenizer(essays_text(), add_special_tokens=False).input_ids
while len(ids) < 8063:
    ids = ids + ids
captured = capture_qkv(model.model, torch.tensor([ids[:8063]]), [1, 8, 15, 28])
torch.save({layer: tuple(t.to(torch.bfloat16) for t in qkv) for layer, qkv in captured.items()}, sys.argv[1])
