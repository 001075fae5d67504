"""Weight-only int8 linears for the CPU fast path.

Each `nn.Linear` of the model (the tied lm_head included) keeps its weight as int8 with
one scale per output row (symmetric, absmax / 127) and computes in bfloat16:

- a few rows at a time (decode: one token) go through PyTorch's int8 weight-pack
  matmul, which reads a quarter of the fp32 bytes: decode is bound by reading weights;
- many rows (a prefill chunk) dequantise the weight to bfloat16 and run an ordinary
  bf16 GEMM, which is about 3x faster than the int8 kernel there and costs one
  dequantisation per chunk.

A layer whose weights are already 4-bit (the embedded GGUF's linears are Q4_1: blocks of
32 on a grid min + step·q, q in 0..15) also keeps them packed in 4 bits, groups of 32
with a bf16 scale and offset each (`pack_int4`), and decodes with PyTorch's int4
weight-pack matmul: decode reads the weights from memory once per token, and half the
bytes is what makes it faster. The int4 copy is kept only where it is at least as close
to the float weight as the int8 one (`int4_if_no_worse`), so a model whose weights are
truly float keeps int8 alone; prefill chunks still run on the int8 weight (the int4
kernel is no faster than int8 there, 2.4x slower than bf16).

Activations stay in bfloat16 throughout (no activation quantisation: dynamic int8
quantisation of activations changes the greedy answer from its first token on the
embedded model; docs/decisions/0004-int8-weights-on-cpu.md).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvchat.runtime import int4_available

# Rows at which the bf16 GEMM on a dequantised weight overtakes the int8 kernel
# (measured on a 2-core EPYC with avx512_bf16: 16 rows int8 wins, 64 rows bf16 wins).
GEMM_ROWS = 32
# The weight cache's layout (`save_quantized`): tensors aligned for memory-mapping, the
# metadata the loader checks, and the int4 copies of the layers that have one. A file of
# another format is quantised again.
CACHE_FORMAT = "3"
# Weights per int4 group (one bf16 scale and offset each): the block size of GGUF's Q4_0/Q4_1.
INT4_GROUP = 32


class Int8Linear(nn.Module):
    """A linear layer with an int8 weight [out, in] and per-row scales."""

    # The buffers `_hold` registers, as the checker should see them.
    weight_int8: Tensor
    scale: Tensor
    bias: Tensor | None
    weight_int4: Tensor | None
    scales_zeros: Tensor | None

    def __init__(self, weight: Tensor, bias: Tensor | None, compute_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        weight_int8, scale = quantize_rows(weight)
        scale = scale.to(compute_dtype)
        int4 = int4_if_no_worse(weight, weight_int8, scale, compute_dtype)
        self._hold(
            weight_int8,
            scale,
            None if bias is None else bias.detach().to(compute_dtype),
            compute_dtype,
            *(int4 or (None, None)),
        )

    @classmethod
    def from_quantized(
        cls,
        weight_int8: Tensor,
        scale: Tensor,
        bias: Tensor | None,
        compute_dtype: torch.dtype = torch.bfloat16,
        weight_int4: Tensor | None = None,
        scales_zeros: Tensor | None = None,
    ) -> Int8Linear:
        """A layer over tensors quantised before (read from the weight cache): nothing is
        computed, the tensors are used as they are."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._hold(weight_int8, scale, bias, compute_dtype, weight_int4, scales_zeros)
        return layer

    def _hold(
        self,
        weight_int8: Tensor,
        scale: Tensor,
        bias: Tensor | None,
        compute_dtype: torch.dtype,
        weight_int4: Tensor | None = None,
        scales_zeros: Tensor | None = None,
    ) -> None:
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)
        self.register_buffer("weight_int4", weight_int4)  # None: no int4 copy (`pack_int4`)
        self.register_buffer("scales_zeros", scales_zeros)
        self.compute_dtype = compute_dtype
        self.out_features, self.in_features = weight_int8.shape

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).to(self.compute_dtype)
        if rows.shape[0] <= GEMM_ROWS:
            if self.weight_int4 is not None:
                out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.weight_int4, INT4_GROUP, self.scales_zeros)
            else:
                out = torch._weight_int8pack_mm(rows, self.weight_int8, self.scale)
            if self.bias is not None:
                out = out + self.bias
        else:
            weight = self.weight_int8.to(self.compute_dtype) * self.scale[:, None]
            out = F.linear(rows, weight, self.bias)
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        four = " (+ int4 for decode)" if self.weight_int4 is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights{four}"


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(int8 weight, float32 scale per row): symmetric, absmax / 127 per output row."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    return (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8), scale


def pack_int4(weight: Tensor, compute_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(packed 4-bit weight, scales and offsets [in / INT4_GROUP, out, 2] in
    `compute_dtype`, the weight those give back in float32). Each group of INT4_GROUP
    inputs of a row is mapped onto 16 levels from its minimum to its maximum, as GGUF's
    Q4_1 does; the kernel computes w = (q - 8) * scale + offset."""
    w = weight.detach().float()
    out_features, in_features = w.shape
    groups = w.reshape(out_features, in_features // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    step = ((high - low) / 15).clamp(min=1e-12)
    q = ((groups - low[..., None]) / step[..., None]).round_().clamp_(0, 15)
    scale = step.to(compute_dtype)
    offset = (low + 8 * step).to(compute_dtype)  # (q - 8) * step + offset = low + q * step
    restored = (q - 8) * scale.float()[..., None] + offset.float()[..., None]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(out_features, in_features).int(), 8)
    return packed, torch.stack([scale.t(), offset.t()], dim=-1).contiguous(), restored.reshape(out_features, -1)


def int4_if_no_worse(
    weight: Tensor, weight_int8: Tensor, scale: Tensor, compute_dtype: torch.dtype
) -> tuple[Tensor, Tensor] | None:
    """The int4 copy of `weight` (`pack_int4`) when it is at least as close to the weight
    as its int8 form (RMS error, scales as stored), else None: a weight that is already
    4-bit (a GGUF Q4 block is exactly min + step·q) loses nothing, a float one keeps int8."""
    if not int4_available() or weight.shape[1] % INT4_GROUP or weight.shape[0] % 16 or weight.device.type != "cpu":
        return None
    w = weight.detach().float()
    packed, scales_zeros, restored = pack_int4(w, compute_dtype)
    int8_error = (weight_int8.float() * scale.float()[:, None] - w).pow(2).mean()
    int4_error = (restored - w).pow(2).mean()
    return (packed, scales_zeros) if int4_error <= int8_error else None


@functools.cache
def int8_available() -> bool:
    """Whether this PyTorch build has the int8 weight-pack matmul on the CPU."""
    try:
        torch._weight_int8pack_mm(
            torch.zeros(1, 64, dtype=torch.bfloat16),
            torch.zeros(8, 64, dtype=torch.int8),
            torch.ones(8, dtype=torch.bfloat16),
        )
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def quantize_linears(model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """Replace every `nn.Linear` of `model` by an `Int8Linear`, in place; the rest of the
    model (embeddings, norms) is cast to `compute_dtype`. A tied lm_head gets its own
    int8 copy; the embedding keeps the float weight for its lookups. Returns how many
    linears were replaced.

    Runs on one intra-op thread: it is a few passes over memory per weight, which one
    thread does nearly as fast as two on an idle machine, and on a busy one every extra
    thread stalls the rest (measured: 1.8 s on one thread against 6.5 s on two, 2 cores
    under load)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model.to(compute_dtype)
        replaced = 0
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Int8Linear(child.weight, child.bias, compute_dtype))
                    replaced += 1
    finally:
        torch.set_num_threads(previous)
    return replaced


# -- the weight cache ------------------------------------------------------------------
# A safetensors file (the format is the standard one: any safetensors reader opens it),
# written so that every tensor whose size is a multiple of ALIGN bytes starts at a
# multiple of ALIGN in the file. The file is then memory-mapped and those tensors are
# used in place (the int8 matmul kernel needs an aligned weight); others are copied.
ALIGN = 64
_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}


def quantized_tensors(model: nn.Module) -> dict[str, Tensor]:
    """What the weight cache holds: a quantised model's parameters and buffers (int8
    weights, scales, the float rest, and the buffers a model computes at construction,
    such as RoPE frequencies)."""
    tensors = {name: t.detach() for name, t in model.named_parameters()}
    tensors.update({name: t.detach() for name, t in model.named_buffers() if t is not None})
    return tensors


def save_quantized(model: nn.Module, path: str, metadata: dict[str, str] | None = None) -> None:
    """Write a quantised model's tensors (`quantized_tensors`) to one safetensors file, so
    later starts skip loading float32 weights and quantising. `metadata` (strings) is
    stored in the header, for the loader to check what the file was made from."""
    import json

    tensors = quantized_tensors(model)
    # Whole multiples of ALIGN first (largest first), so each of them starts aligned.
    order = sorted(tensors, key=lambda n: (tensors[n].nbytes % ALIGN != 0, -tensors[n].nbytes, n))
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for name in order:
        t = tensors[name]
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)  # the data starts at a multiple of ALIGN
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in order:
            t = tensors[name].contiguous().reshape(-1)
            f.write(memoryview(t.view(torch.uint8).numpy()) if t.numel() else b"")  # type: ignore[arg-type]  # ndarray is a buffer


def _quantized_one_by_one(model: nn.Module, compute_dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """The tensors `quantized_tensors` would hold after `quantize_linears(model)`, by the
    same names and with the same numbers, made one module at a time from the float model
    (which `quantize_linears` would first cast whole to `compute_dtype`)."""
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        key = f"{prefix}." if prefix else ""
        if isinstance(module, nn.Linear):
            bias = None if module.bias is None else module.bias.detach().to(compute_dtype)
            layer = Int8Linear(module.weight.detach().to(compute_dtype), bias, compute_dtype)
            for name, buffer in layer.named_buffers():
                yield key + name, buffer
            continue
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is None or id(tensor) in seen:
                continue  # a tied weight goes in once, under its first name
            seen.add(id(tensor))
            tensor = tensor.detach()
            yield key + name, tensor.to(compute_dtype) if tensor.is_floating_point() else tensor


def quantize_to_file(
    model: nn.Module, path: str, metadata: dict[str, str] | None = None, compute_dtype: torch.dtype = torch.bfloat16
) -> None:
    """Write the weight cache `quantize_linears` then `save_quantized` would write for the
    float `model`, without building the quantised model: one linear at a time is
    quantised and its tensors written, so a float model memory-mapped from its file is
    never copied whole (`quantize_linears` casts all of it to `compute_dtype` first).
    `model` is left as it was. Which linears keep an int4 copy is known only once they
    are quantised, so room for the header is reserved up front and the header written
    last; tensors whose size is not a multiple of ALIGN (biases, small norms) are kept
    and written at the end, so every other tensor starts aligned."""
    import json

    names = [
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        for name in (
            ("weight_int8", "scale", "bias", "weight_int4", "scales_zeros")
            if isinstance(module, nn.Linear)
            else [*module._parameters, *module._buffers]
        )
    ]
    # What the header can take at most: every name, with a dtype, a shape of up to 8
    # dimensions and two offsets of up to 20 digits each.
    room = len(json.dumps(dict(metadata or {}))) + sum(len(json.dumps(name)) + 256 for name in names) + 64
    room += -(8 + room) % ALIGN
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    unaligned: list[tuple[str, Tensor]] = []
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # as `quantize_linears`, for the same reasons
    try:
        with open(path, "wb") as f:
            f.seek(8 + room)
            offset = 0

            def put(name: str, tensor: Tensor) -> None:
                nonlocal offset
                flat = tensor.contiguous().reshape(-1)
                header[name] = {
                    "dtype": _DTYPES[flat.dtype],
                    "shape": list(tensor.shape),
                    "data_offsets": [offset, offset + flat.nbytes],
                }
                f.write(memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else b"")  # type: ignore[arg-type]  # ndarray is a buffer
                offset += flat.nbytes

            for name, tensor in _quantized_one_by_one(model, compute_dtype):
                if tensor.nbytes % ALIGN:
                    unaligned.append((name, tensor))
                else:
                    put(name, tensor)
            for name, tensor in unaligned:
                put(name, tensor)
            raw = json.dumps(header, separators=(",", ":")).encode()
            if len(raw) > room:
                raise ValueError(f"the header of {path} outgrew its room ({len(raw)} > {room} bytes)")
            f.seek(0)
            f.write(room.to_bytes(8, "little"))
            f.write(raw + b" " * (room - len(raw)))
    finally:
        torch.set_num_threads(previous)


def read_metadata(path: str) -> dict[str, str]:
    """The `__metadata__` of a safetensors file (reads its header only)."""
    import json

    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size < 100_000_000:
            raise ValueError(f"{path} is not a safetensors file")
        return dict(json.loads(f.read(size)).get("__metadata__") or {})


def load_quantized(config: object, path: str, compute_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Build the model of `config` without initialising weights (on the meta device), and
    give it the tensors saved by `save_quantized`, memory-mapped from the file: its linears
    become `Int8Linear`s over the stored int8 weights and scales, nothing is computed."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=compute_dtype)
    tensors = {name: _aligned(t) for name, t in load_file(path).items()}
    used: set[str] = set()
    linears = [
        (prefix, parent, name, child)
        for prefix, parent in model.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for prefix, parent, name, child in linears:
        key = f"{prefix}.{name}" if prefix else name
        parts = [f"{key}.weight_int8", f"{key}.scale"] + ([f"{key}.bias"] if child.bias is not None else [])
        weight = tensors.get(parts[0])
        if (
            not all(p in tensors for p in parts)
            or weight is None
            or weight.dtype != torch.int8
            or (tuple(weight.shape) != (child.out_features, child.in_features))
        ):
            raise ValueError(f"{path} does not match the model (the int8 weight of {key})")
        bias = tensors[parts[2]] if child.bias is not None else None
        four = [f"{key}.weight_int4", f"{key}.scales_zeros"]
        int4 = (tensors[four[0]], tensors[four[1]]) if all(p in tensors for p in four) else (None, None)
        setattr(parent, name, Int8Linear.from_quantized(weight, tensors[parts[1]], bias, compute_dtype, *int4))
        used.update(parts + four)
    expected = {name for name, _ in model.named_parameters()} | {
        name for name, t in model.named_buffers() if t is not None
    }
    if set(tensors) != expected:
        raise ValueError(f"{path} does not match the model ({len(set(tensors) ^ expected)} tensors differ)")
    for name, tensor in tensors.items():
        if name in used:
            continue
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        if attr in module._parameters:
            module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
        else:
            module._buffers[attr] = tensor
    return model.eval()


def _aligned(tensor: Tensor) -> Tensor:
    """`tensor` itself when it starts at a multiple of ALIGN bytes, else an aligned copy
    (the int8 matmul kernel crashes on an unaligned weight)."""
    return tensor if tensor.data_ptr() % ALIGN == 0 else tensor.clone()
