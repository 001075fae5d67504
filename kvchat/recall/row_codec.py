"""How one cold token's key and value are laid out on disk: 8-bit keys and 4-bit values.

A cold row is read back only when a step recalls it, and then attended beside hundreds of
exact tokens; on disk it is kept for the whole session, one row per token and retrieval
layer. So the rows are quantised, per token and KV head:

- the key as int8 codes with one scale (symmetric: code = round(k / s), s = max|k| / 127);
- the value as 4-bit codes with a minimum and a step (v = lo + code · step, step =
  (max - min) / 15), two codes a byte, the even channel in the low nibble;
- the three numbers as float16, first, so that they sit at even offsets.

One head's unit is `unit_bytes(d)`: 6 + d + d/2 bytes (102 for d = 64, against 256 in
float16 and 512 in float32), rounded up to an even count; a token's row is one unit per
KV head, [H, unit]. Values tolerate fewer bits than keys: an error in a key is
exponentiated by the softmax, one in a value is only averaged (KIVI, arXiv 2402.02750,
makes the same split). Why 8 and 4 bits: docs/decisions/0017-quantised-cold-rows.md.

Keys are stored before RoPE (`kvchat.recall.tier` turns them back at each read), so no
compaction ever rewrites a row and no error accumulates. Tensors only.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Bytes of the float16 scale, minimum and step at the start of a head's unit.
PARAM_BYTES = 6
KEY_LEVELS = 127  # int8 codes -127..127
VALUE_LEVELS = 15  # 4-bit codes 0..15


def unit_bytes(head_dim: int) -> int:
    """Bytes of one KV head's key and value in a cold row."""
    raw = PARAM_BYTES + head_dim + (head_dim + 1) // 2
    return raw + raw % 2


def encode(keys: Tensor, values: Tensor) -> Tensor:
    """Rows uint8 [n, H, unit] of `keys` and `values` [H, n, d] (any float dtype)."""
    h, n, d = keys.shape
    k = keys.detach().to("cpu", torch.float32)
    v = values.detach().to("cpu", torch.float32)
    scale = (k.abs().amax(-1, keepdim=True) / KEY_LEVELS).to(torch.float16)
    s = scale.float()
    key_codes = torch.where(s > 0, torch.round(k / s.clamp(min=1e-30)), 0.0).clamp(-KEY_LEVELS, KEY_LEVELS)
    lo = v.amin(-1, keepdim=True).to(torch.float16)
    step = ((v.amax(-1, keepdim=True) - lo.float()) / VALUE_LEVELS).to(torch.float16)
    st = step.float()
    value_codes = torch.where(st > 0, torch.round((v - lo.float()) / st.clamp(min=1e-30)), 0.0)
    value_codes = value_codes.clamp(0, VALUE_LEVELS).to(torch.uint8)
    if d % 2:
        value_codes = torch.cat([value_codes, value_codes.new_zeros(h, n, 1)], -1)
    packed = value_codes[..., 0::2] | (value_codes[..., 1::2] << 4)
    out = torch.zeros(n, h, unit_bytes(d), dtype=torch.uint8)
    params = torch.cat([scale, lo, step], -1)  # [H, n, 3] float16
    out[..., :PARAM_BYTES] = params.transpose(0, 1).contiguous().view(torch.uint8)
    out[..., PARAM_BYTES : PARAM_BYTES + d] = key_codes.to(torch.int8).transpose(0, 1).view(torch.uint8)
    out[..., PARAM_BYTES + d : PARAM_BYTES + d + packed.shape[-1]] = packed.transpose(0, 1)
    return out


def decode(units: Tensor, head_dim: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Keys and values [..., d] in `dtype` from units uint8 [..., unit] (`encode`'s rows, or
    any gather of their heads' units)."""
    d = head_dim
    params = units[..., :PARAM_BYTES].contiguous().view(torch.float16).float()  # [..., 3]
    key_codes = units[..., PARAM_BYTES : PARAM_BYTES + d].contiguous().view(torch.int8)
    keys = key_codes.float() * params[..., 0:1]
    packed = units[..., PARAM_BYTES + d : PARAM_BYTES + d + (d + 1) // 2]
    codes = torch.stack([packed & 15, packed >> 4], -1).flatten(-2)[..., :d]
    values = torch.addcmul(params[..., 1:2], codes.float(), params[..., 2:3])
    return keys.to(dtype), values.to(dtype)
