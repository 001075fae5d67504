"""Weight-only int8 linears for the CPU fast path.

Each `nn.Linear` of the model (the tied lm_head included) keeps its weight as int8 with
one scale per output row (symmetric, absmax / 127) and computes in bfloat16:

- a few rows at a time (decode: one token) go through PyTorch's int8 weight-pack
  matmul, which reads a quarter of the fp32 bytes: decode is bound by reading weights;
- many rows (a prefill chunk) dequantise the weight to bfloat16 and run an ordinary
  bf16 GEMM, which is about 3x faster than the int8 kernel there and costs one
  dequantisation per chunk.

Activations stay in bfloat16 throughout (no activation quantisation: dynamic int8
quantisation of activations changed the greedy answer from the first token on the
embedded model, weight-only int8 does not; see docs/BENCHMARKS.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Rows at which the bf16 GEMM on a dequantised weight overtakes the int8 kernel
# (measured on a 2-core EPYC with avx512_bf16: 16 rows int8 wins, 64 rows bf16 wins).
GEMM_ROWS = 32


class Int8Linear(nn.Module):
    """A linear layer with an int8 weight [out, in] and per-row scales."""

    def __init__(self, weight: Tensor, bias: Tensor | None, compute_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(compute_dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().to(compute_dtype))
        self.compute_dtype = compute_dtype
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).to(self.compute_dtype)
        if rows.shape[0] <= GEMM_ROWS:
            out = torch._weight_int8pack_mm(rows, self.weight_int8, self.scale)
            if self.bias is not None:
                out = out + self.bias
        else:
            weight = self.weight_int8.to(self.compute_dtype) * self.scale[:, None]
            out = F.linear(rows, weight, self.bias)
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


def int8_available() -> bool:
    """Whether this PyTorch build has the int8 weight-pack matmul on the CPU."""
    try:
        torch._weight_int8pack_mm(
            torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.int8),
            torch.ones(8, dtype=torch.bfloat16),
        )
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def quantize_linears(model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """Replace every `nn.Linear` of `model` by an `Int8Linear`, in place; the rest of the
    model (embeddings, norms) is cast to `compute_dtype`. A tied lm_head gets its own
    int8 copy; the embedding keeps the float weight for its lookups. Returns how many
    linears were replaced."""
    model.to(compute_dtype)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child.weight, child.bias, compute_dtype))
                replaced += 1
    return replaced


def save_quantized(model: nn.Module, path: str) -> None:
    """Write a quantised model's tensors (int8 weights, scales, the float rest, and the
    buffers a model computes at construction, such as RoPE frequencies) to one
    safetensors file, so later starts skip loading float32 weights and quantising."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().contiguous() for name, t in model.named_parameters()}
    tensors.update({name: t.detach().contiguous() for name, t in model.named_buffers() if t is not None})
    save_file(tensors, path)


def load_quantized(config: object, path: str, compute_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Build the model of `config` without initialising weights (on the meta device), swap
    its linears for int8 shells and assign the tensors saved by `save_quantized`."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=compute_dtype)
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    shell = Int8Linear(torch.empty(child.out_features, child.in_features), child.bias, compute_dtype)
                    setattr(parent, name, shell)
    tensors = load_file(path)
    expected = {name for name, _ in model.named_parameters()} | {
        name for name, t in model.named_buffers() if t is not None
    }
    if set(tensors) != expected:
        raise ValueError(f"{path} does not match the model ({len(set(tensors) ^ expected)} tensors differ)")
    for name, tensor in tensors.items():
        # A copy: tensors read from the file may sit at unaligned offsets, and the int8
        # matmul kernel crashes on an unaligned weight.
        tensor = tensor.clone()
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        if attr in module._parameters:
            module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
        else:
            module._buffers[attr] = tensor
    return model.eval()
