"""Scoring every cold row of the recall index: the portable path (unpack the 4-bit codes,
one batched matmul) against PyTorch's CPU int4 kernel, the codes of all KV heads in one
call (cross-head products thrown away) or one call per KV head (what
kvchat/keyindex.py's PackedKeyIndex does). One thread, 3 KV heads, 3 queries per head, 32
channels; µs per call, mean of 200 after 10 warm-up calls; maxerr = the largest
difference of the per-head kernel's scores from the portable ones.

    python docs/bench/keyindex/score_kernels.py   (scores.txt: what it printed)
"""
import time, torch
torch.set_num_threads(1)
from kvchat.keyindex import KeyIndex
H, d, g = 3, 64, 3
ch = torch.cat([torch.arange(16), torch.arange(16) + 32])
def bench(f, n=200):
    for _ in range(10): f()
    t = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t) / n * 1e6
for rows in (1216, 4096, 7168):
    idx = KeyIndex(H, d, torch.device("cpu"), ch)
    keys = torch.randn(H, rows, d)
    idx.append(keys, torch.arange(rows))
    q = torch.randn(H * g, 1, d).bfloat16()
    qq = q.reshape(H, g, d)
    cur = bench(lambda: idx.scores(qq))
    # int4pack: codes [H*rows, 32] int32 -> packed
    k = keys[..., ch].float()
    lo = k.amin(-1); step = ((k.amax(-1) - lo) / 15).clamp(min=1e-12)
    code = ((k - lo[..., None]) / step[..., None]).round().clamp(0, 15).int()
    packed_all = torch.ops.aten._convert_weight_to_int4pack_for_cpu(code.reshape(H * rows, 32), 8)
    sz_all = torch.stack([step, lo + 8 * step], -1).reshape(1, H * rows, 2).bfloat16()
    qa = q.reshape(H * g, d)[:, ch].contiguous()
    def combined():
        o = torch.ops.aten._weight_int4pack_mm_for_cpu(qa, packed_all, 32, sz_all)
        return o.view(H, g, H, rows).diagonal(dim1=0, dim2=2).amax(0)
    packs = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(code[h], 8) for h in range(H)]
    szs = [torch.stack([step[h], lo[h] + 8 * step[h]], -1)[None].bfloat16().contiguous() for h in range(H)]
    qh = [qa[h * g:(h + 1) * g].contiguous() for h in range(H)]
    def perhead():
        return torch.stack([torch.ops.aten._weight_int4pack_mm_for_cpu(qh[h], packs[h], 32, szs[h]).amax(0) for h in range(H)])
    ref = idx.scores(qq)
    err = (perhead().float() - ref).abs().max().item()
    print(rows, f"current {cur:.0f} us  combined {bench(combined):.0f} us  perhead {bench(perhead):.0f} us  maxerr {err:.3f} (scale {ref.abs().max():.1f})")
