"""kvchat's compiled kernels: one loader, one switch, one checked wrapper per operation.

Four C extensions, each optional (pyproject.toml builds them where a C compiler is, and
the install goes on without one); a kernel that is missing or switched off leaves its
operation to the caller's PyTorch or NumPy path, which computes the same result:

- `coldrank` (`_coldrank.c`): the recall tier's ranking of cold rows from their 4-bit key
  codes, the packing of those codes, and the read of rows from the cold files
  (`kvchat.recall.key_index`, `kvchat.recall.cold_store`). Its ranking runs on one of three
  paths, `RANKING_PATHS`: AVX512-VNNI, AVX2 with FMA, or a plain loop; all three give the
  same scores to the bit. Recall is on by default only where the ranking runs on a vector
  path (`ranking_path`, read by `kvchat.model.engine`).
- `greedy` (`_greedy.c`): bumblebee's offline greedy (Algorithm 1).
- `summary` (`_summary.c`): bumblebee's streaming append and eviction rounds.
- `farthest` (`_farthest.c`): subgen's farthest-first centres.

The compressors' kernels have an AVX-512 path and a plain loop that give the same numbers;
the AVX-512 one runs where the CPU has it.

**The switch** (`Settings`): which kernels run and which paths they take, read at import
from the environment, for benchmarks and comparisons:

- `KVCHAT_KERNELS`: a comma-separated list applied in order to "every kernel on":
  `off` (or `none`) turns every kernel off, `on` (or `all`) every one on, `-greedy` one
  off, `greedy` or `+greedy` one on; `-avx512` sends the compressors' kernels to their
  plain loops. `KVCHAT_KERNELS=off,coldrank` runs the recall kernel alone.
- `KVCHAT_RANKING_PATH`: `vnni`, `avx2` or `scalar` forces the ranking's path (`auto`:
  the fastest this CPU runs).

In code, `configure(...)` changes the settings and `with kernels(...):` changes them for
a block (the tests' comparisons of a kernel with its Python twin). Callers ask
`use(name)` whether a kernel runs.

**Checked calls**: the extensions take raw addresses; only the wrappers here call them
(`pack_codes`, `rank_scores`, `rank_top_rows`, `gather_rows`, `greedy_picks`,
`summary_append`, `summary_shrink`, `farthest_centres`). Each checks the dtype, device
(the CPU), contiguity and shape of every buffer, and the sizes that index them, and raises
ValueError with the buffer's name instead of letting a wrong call read or write out of
bounds. The C functions check what only the data says (a channel index, a row outside
the store).

`status()` says what was built and what runs, `describe_status()` the same as text
(`kvchat --version`). This module imports no torch: it reads tensors and NumPy arrays
through their attributes.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeGuard, cast

if TYPE_CHECKING:
    import numpy as np
    from torch import Tensor

    Buffer = Tensor | np.ndarray

# The kernels, by the name the switch, `use` and `status` know them by.
KERNELS = ("coldrank", "greedy", "summary", "farthest")
# The ranking kernel's paths, fastest first, and the number each is called with.
RANKING_PATHS = ("vnni", "avx2", "scalar")
_PATH_NUMBER = {"vnni": 2, "avx2": 1, "scalar": 0}
# What takes a kernel's place where it does not run.
_FALLBACK = {"coldrank": "PyTorch", "greedy": "Python loop", "summary": "NumPy rounds", "farthest": "torch loop"}
_WHAT = {
    "coldrank": "recall ranking and row reads",
    "greedy": "bumblebee's offline greedy",
    "summary": "bumblebee's streaming rounds",
    "farthest": "subgen's farthest-first",
}
# Channels the ranking kernel takes at most, and rows of a block of its layout.
MAX_CHANNELS = 256
BLOCK = 16


def _load(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"kvchat.native._{name}")
    except ImportError:  # not built: no compiler at install time
        return None


_EXTENSIONS: dict[str, ModuleType | None] = {name: _load(name) for name in KERNELS}


# ---- the switch -----------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """Which kernels run (a kernel that is not built never does) and which paths they take.

    Each kernel's flag: False sends its callers to their PyTorch or NumPy path.
    `ranking_path`: None, the fastest path of the ranking kernel this CPU runs, or one of
    `RANKING_PATHS`. `avx512`: False runs the compressors' kernels' plain loops on a CPU
    with AVX-512."""

    coldrank: bool = True
    greedy: bool = True
    summary: bool = True
    farthest: bool = True
    ranking_path: str | None = None
    avx512: bool = True

    def __post_init__(self) -> None:
        if self.ranking_path is not None and self.ranking_path not in RANKING_PATHS:
            raise ValueError(f"ranking path {self.ranking_path!r}: not one of {', '.join(RANKING_PATHS)}")


def parse_settings(environ: Mapping[str, str]) -> Settings:
    """The settings `KVCHAT_KERNELS` and `KVCHAT_RANKING_PATH` in `environ` ask for (the
    module docstring); ValueError for a word it does not know."""
    flags = dict.fromkeys((*KERNELS, "avx512"), True)
    for word in (w.strip().lower() for w in environ.get("KVCHAT_KERNELS", "").split(",")):
        if not word:
            continue
        if word in ("on", "all", "off", "none"):
            flags.update(dict.fromkeys(KERNELS, word in ("on", "all")))
            continue
        name = word.lstrip("+-")
        if name not in flags:
            raise ValueError(f"KVCHAT_KERNELS: {word!r} names no kernel ({', '.join(KERNELS)}, avx512; on, off)")
        flags[name] = not word.startswith("-")
    path = environ.get("KVCHAT_RANKING_PATH", "").strip().lower()
    if path not in ("", "auto", *RANKING_PATHS):
        raise ValueError(f"KVCHAT_RANKING_PATH: {path!r} is not auto, {', '.join(RANKING_PATHS)}")
    return Settings(**flags, ranking_path=path if path in RANKING_PATHS else None)


def _initial_settings() -> Settings:
    try:
        return _checked(parse_settings(os.environ))
    except ValueError as error:
        warnings.warn(f"{error}; kvchat's kernels run at their defaults", RuntimeWarning, stacklevel=2)
        return Settings()


def _checked(settings: Settings) -> Settings:
    """`settings`, once the ranking path it forces is known to run here."""
    path = settings.ranking_path
    if path is not None and _EXTENSIONS["coldrank"] is not None and path not in ranking_paths():
        raise ValueError(f"ranking path {path!r}: this CPU does not run it (it runs {', '.join(ranking_paths())})")
    return settings


def settings() -> Settings:
    """The settings now in force."""
    return _settings


def configure(settings: Settings | None = None, /, **changes: Any) -> Settings:
    """Put `settings` (default: those in force), with `changes` to its fields, in force;
    returns them. ValueError for a ranking path this CPU does not run."""
    global _settings
    base = _settings if settings is None else settings
    _settings = _checked(dataclasses.replace(base, **changes))
    return _settings


@contextmanager
def kernels(settings: Settings | None = None, /, **changes: Any) -> Iterator[Settings]:
    """`configure(settings, **changes)` for the block, the settings before it restored
    after: `with native.kernels(greedy=False): ...`."""
    before = _settings
    try:
        yield configure(settings, **changes)
    finally:
        _set(before)


def _set(settings: Settings) -> None:
    global _settings
    _settings = settings


def built(name: str) -> bool:
    """Whether kernel `name` was built (it may still be switched off)."""
    _known(name)
    return _EXTENSIONS[name] is not None


def use(name: str) -> bool:
    """Whether kernel `name` runs: built and switched on. (For `coldrank` that is its
    packing and row reads; its ranking also needs `ranking_path()`.)"""
    return built(name) and bool(getattr(_settings, name))


def _known(name: str) -> None:
    if name not in _EXTENSIONS:
        raise ValueError(f"no kernel named {name!r} (kernels: {', '.join(KERNELS)})")


@functools.cache
def ranking_paths() -> tuple[str, ...]:
    """The ranking kernel's paths this CPU runs, fastest first ("scalar" runs on every
    one); none where the kernel is not built."""
    ext = _EXTENSIONS["coldrank"]
    if ext is None:
        return ()
    return ("vnni",) * bool(ext.vnni()) + ("avx2",) * bool(ext.avx2()) + ("scalar",)


def ranking_path() -> str | None:
    """The ranking kernel's path here: the one the settings force, else "vnni"
    (AVX512-VNNI) or "avx2" (AVX2 and FMA); None where it does not rank (not built,
    switched off, or a CPU with neither: the PyTorch layouts of `kvchat.recall.key_index`
    rank then)."""
    if not use("coldrank"):
        return None
    if _settings.ranking_path is not None:
        return _settings.ranking_path
    fastest = ranking_paths()[0]
    return None if fastest == "scalar" else fastest


@functools.cache
def cpu_has_avx512() -> bool:
    """Whether this CPU runs the compressors' kernels' AVX-512 path (asked of whichever of
    them is built; False where none is)."""
    for name in ("greedy", "summary", "farthest"):
        ext = _EXTENSIONS[name]
        if ext is not None:
            return bool(ext.vector())
    return False


def _vector() -> bool:
    return _settings.avx512 and cpu_has_avx512()


# ---- what runs --------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelStatus:
    """One kernel: whether it was built, whether it runs (built and switched on), and its
    path: for `coldrank` the ranking path (None where it does not rank), for the others
    "avx512" or "scalar" (None where it does not run)."""

    name: str
    built: bool
    enabled: bool
    path: str | None


@dataclass(frozen=True)
class Status:
    """What `status()` reports: each kernel, and the ranking path (`ranking_path()`)."""

    coldrank: KernelStatus
    greedy: KernelStatus
    summary: KernelStatus
    farthest: KernelStatus
    ranking_path: str | None

    @property
    def kernels(self) -> tuple[KernelStatus, ...]:
        return tuple(getattr(self, name) for name in KERNELS)


def status() -> Status:
    """Which kernels were built, which run, and on which paths, under the settings in
    force."""

    def one(name: str) -> KernelStatus:
        enabled = use(name)
        if name == "coldrank":
            path = ranking_path()
        else:
            path = ("avx512" if _vector() else "scalar") if enabled else None
        return KernelStatus(name, built(name), enabled, path)

    # one KernelStatus per field before ranking_path, in KERNELS' order (the checker cannot count a generator)
    return Status(*(one(name) for name in KERNELS), ranking_path=ranking_path())  # type: ignore[misc, arg-type]


def describe_status(state: Status | None = None) -> str:
    """`status()` as text, one line a kernel: what it does, built or not, on or off, its
    path (or what runs in its place)."""
    lines = []
    for k in (state or status()).kernels:
        head = f"{k.name:<9} {_WHAT[k.name]:<29}"
        if not k.built:
            lines.append(f"{head} not built: {_FALLBACK[k.name]}")
        elif not k.enabled:
            lines.append(f"{head} built, switched off: {_FALLBACK[k.name]}")
        elif k.name == "coldrank" and k.path is None:
            lines.append(f"{head} on (row reads); ranking in {_FALLBACK[k.name]} (no AVX2 or AVX512-VNNI)")
        else:
            lines.append(f"{head} on, {k.path} path")
    return "\n".join(lines)


_settings = _initial_settings()


# ---- checked arguments ---------------------------------------------------------------


def _dtype(a: Any) -> str:
    return str(a.dtype).removeprefix("torch.")


def _is_tensor(a: Any) -> TypeGuard[Tensor]:
    return hasattr(a, "data_ptr") and hasattr(a, "device")


def _is_array(a: Any) -> bool:
    return hasattr(a, "ctypes") and hasattr(a, "flags")


def _dims(name: str, a: Any, labels: str) -> tuple[int, ...]:
    """The shape of buffer `a` once it is a tensor or an array with as many dimensions as
    `labels` names ("heads, rows, channels")."""
    if not (_is_tensor(a) or _is_array(a)):
        raise ValueError(f"{name} must be a tensor or an array, not {type(a).__name__}")
    if len(a.shape) != len(labels.split(", ")):
        raise ValueError(f"{name} must be shaped [{labels}], not {list(a.shape)}")
    return tuple(a.shape)


def _address(name: str, a: Any, dtypes: Sequence[str], shape: Sequence[int | None], out: bool = False) -> int:
    """The address of buffer `a` (a torch tensor or a NumPy array) once it is checked: one
    of `dtypes`, on the CPU, shaped `shape` (None: any size), contiguous, and writable
    when it is an output. ValueError naming `name` otherwise."""
    if _is_tensor(a):
        if a.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, not {a.device}")
        contiguous, writable = a.is_contiguous(), True
    elif _is_array(a):
        contiguous, writable = a.flags.c_contiguous, a.flags.writeable
    else:
        raise ValueError(f"{name} must be a tensor or an array, not {type(a).__name__}")
    if _dtype(a) not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(dtypes)}, not {_dtype(a)}")
    if len(a.shape) != len(shape) or any(want is not None and want != got for want, got in zip(shape, a.shape)):
        wanted = ", ".join("*" if want is None else str(want) for want in shape)
        raise ValueError(f"{name} must be shaped [{wanted}], not {list(a.shape)}")
    if not contiguous:
        raise ValueError(f"{name} must be contiguous")
    if out and not writable:
        raise ValueError(f"{name} must be writable")
    return a.data_ptr() if _is_tensor(a) else a.ctypes.data


def _within(name: str, value: int, low: int, high: int) -> int:
    """`value` as an int, ValueError unless low <= value <= high."""
    value = int(value)
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], not {value}")
    return value


def _extension(name: str) -> Any:
    ext = _EXTENSIONS[name]
    if ext is None:
        raise RuntimeError(f"kvchat.native._{name} is not built (no C compiler at install)")
    return ext


def _path_number(path: str | None) -> int:
    """The number the ranking kernel takes for `path` (None: `ranking_path()`, the plain
    loop where that is None)."""
    path = ranking_path() if path is None else path
    path = "scalar" if path is None else path
    if path not in ranking_paths():
        raise ValueError(f"ranking path {path!r}: this CPU runs {', '.join(ranking_paths()) or 'none'}")
    return _PATH_NUMBER[path]


# ---- coldrank: the recall tier ----------------------------------------------------------


def pack_codes(codes: Buffer, blocks: Buffer, first: int) -> None:
    """Write 4-bit codes uint8 [H, b, m] (values 0..15, ranking channel order) as rows
    `first` .. `first + b` of `blocks` uint8 [H, capacity / 16, 8m], the ranking
    kernel's layout (`kvchat/native/_coldrank.c`)."""
    ext = _extension("coldrank")
    heads, b, m = _dims("codes", codes, "heads, rows, channels")
    _channel_count(m)
    at = _address("codes", codes, ("uint8",), (heads, b, m))
    dest = _address("blocks", blocks, ("uint8",), (heads, None, 8 * m), out=True)
    capacity = blocks.shape[1] * BLOCK
    first = _within("first", first, 0, capacity - b)
    ext.pack(at, heads, b, m, dest, capacity, first)


def _channel_count(m: int) -> None:
    if m <= 0 or m % 8 or m > MAX_CHANNELS:
        raise ValueError(f"the ranking kernel takes a multiple of 8 channels up to {MAX_CHANNELS}, not {m}")


def _rank_args(blocks: Buffer, lo: Buffer, step: Buffer, rows: int, query: Buffer, channels: Buffer) -> tuple:
    """The arguments `rank_scores` and `rank_top_rows` share, checked."""
    heads, count, width = _dims("blocks", blocks, "heads, blocks, 8 * channels")
    m, capacity = width // 8, count * BLOCK
    _channel_count(m)
    _, queries, d = _dims("query", query, "heads, queries, channels")
    return (
        _address("blocks", blocks, ("uint8",), (heads, count, 8 * m)),
        _address("lo", lo, ("bfloat16",), (heads, capacity)),
        _address("step", step, ("bfloat16",), (heads, capacity)),
    ), (
        capacity,
        _within("rows", rows, 1, capacity),
        heads,
        m,
        _address("query", query, ("float32", "bfloat16"), (heads, None, None)),
        int(_dtype(query) == "bfloat16"),
        _within("query channels", d, 1, 1 << 20),
        _within("queries", queries, 1, 1 << 30),
        _address("channels", channels, ("int64",), (m,)),
    )


def rank_scores(
    blocks: Buffer,
    lo: Buffer,
    step: Buffer,
    rows: int,
    query: Buffer,
    channels: Buffer,
    out: Buffer,
    path: str | None = None,
) -> None:
    """Every cold row's score into `out` float32 [H, rows]: for each KV head the largest
    over its queries of q·k as the 4-bit codes give it. The index: `blocks` uint8
    [H, capacity / 16, 8m] (`pack_codes`), `lo` and `step` bfloat16 [H, capacity], its
    first `rows` rows live; `query` float32 or bfloat16 [H, n, d], `channels` int64 [m]
    (the ranking channels among the d). `path`: one of `ranking_paths()`, None for
    `ranking_path()`."""
    buffers, shape = _rank_args(blocks, lo, step, rows, query, channels)
    target = _address("out", out, ("float32",), (blocks.shape[0], shape[1]), out=True)
    _extension("coldrank").scores(*buffers, *shape, target, _path_number(path))


def rank_top_rows(
    blocks: Buffer,
    lo: Buffer,
    step: Buffer,
    rows: int,
    query: Buffer,
    channels: Buffer,
    out: Buffer,
    bias: Buffer | None = None,
    path: str | None = None,
) -> None:
    """Each KV head's k best rows by `rank_scores`' score into `out` int64 [H, k]
    (1 <= k <= rows), in no order; `bias` float32 [H, at least rows] is added to the
    scores first (-inf: a row chosen only where fewer than k others are left)."""
    buffers, shape = _rank_args(blocks, lo, step, rows, query, channels)
    heads, live = blocks.shape[0], shape[1]
    target = _address("out", out, ("int64",), (heads, None), out=True)
    k = _within("k (out's columns)", out.shape[1], 1, live)
    if bias is None:
        bias_at = bias_rows = 0
    else:
        bias_at = _address("bias", bias, ("float32",), (heads, None))
        bias_rows = _within("bias columns", bias.shape[1], live, 1 << 62)
    _extension("coldrank").top_rows(*buffers, bias_at, bias_rows, *shape, k, target, _path_number(path))


def gather_rows(sources: Sequence[tuple[Buffer | None, int, int, int]], rows: Buffer, out: Buffer) -> None:
    """Copy cold rows' quantised units (`kvchat.recall.row_codec`) into `out` uint8
    [H, k, unit]. `rows` int64 [H, k]: each head's rows. `sources`: (view, first, stop,
    base) each, rows [first, stop) of the store being rows r - base of `view` uint8
    [capacity, H, unit] (a cold file's mapping); a later source holds the rows it names.
    IndexError for a row that no source holds."""
    heads, k, unit = _dims("out", out, "heads, rows, unit")
    target = _address("out", out, ("uint8",), (heads, k, unit), out=True)
    where = []
    for i, (view, first, stop, base) in enumerate(sources):
        at = _address(f"source {i}", view, ("uint8",), (None, heads, unit))
        # (rows past the mapping's end are outside the store; `_address` refused a None view)
        where.append((at, int(first), min(int(stop), int(base) + cast("Buffer", view).shape[0]), int(base)))
    at = _address("rows", rows, ("int64",), (heads, k))
    _extension("coldrank").gather(where, at, heads, k, unit, target)


# ---- the compressors' kernels ---------------------------------------------------------


def greedy_picks(
    cosines: Buffer,
    *,
    picked: int,
    sample: int,
    draws: Buffer,
    head: int,
    count: Buffer | None,
    weight: float,
    mass: Buffer,
    out: Buffer,
    lam: float,
    phi_log: bool,
    alpha: float,
    beta: float,
    minmax: bool,
) -> None:
    """bumblebee's offline greedy for one KV head (`_greedy.c`; `BumbleBee._greedy` states
    the rule): `picked` picks into `out` int64 [picked], in the order made.
    `cosines` bfloat16 or float32 [n, n], every pair's cosine; `draws` float32
    [steps, heads, sample], the uniform draws of every head of the layer (`head` is this
    one), at least one step for each step that samples; `count` float32 [n] or None (every
    entry one token) and `weight` its sum; `mass` float64 [groups, n]; the objective's
    `lam`, `phi_log` (phi = log1p, else the power phi of `alpha` and `beta`) and
    `minmax`."""
    ext = _extension("greedy")
    n = _dims("cosines", cosines, "n, n")[0]
    steps, heads, _ = _dims("draws", draws, "steps, heads, sample")
    groups = _dims("mass", mass, "groups, n")[0]
    _within("n", n, 1, 1 << 62)
    picked = _within("picked", picked, 0, n)
    sample = _within("sample", sample, 1, 1 << 62)
    head = _within("head", head, 0, heads - 1)
    _within("draws' steps", steps, max(0, min(picked, n - sample)), 1 << 62)
    ext.greedy(
        _address("cosines", cosines, ("bfloat16", "float32"), (n, n)),
        int(_dtype(cosines) == "bfloat16"),
        n,
        picked,
        sample,
        _address("draws", draws, ("float32",), (steps, heads, sample)),
        steps,
        heads,
        head,
        0 if count is None else _address("count", count, ("float32",), (n,)),
        float(weight),
        _address("mass", mass, ("float64",), (groups, n)),
        groups,
        float(lam),
        bool(phi_log),
        float(alpha),
        float(beta),
        bool(minmax),
        _address("out", out, ("int64",), (picked,), out=True),
        _vector(),
    )


def _summary_shape(unit: Buffer, nn_sim: Buffer, nn_idx: Buffer) -> tuple[int, int, int, int, int, int]:
    heads, n, d = _dims("unit", unit, "heads, n, d")
    _within("d", d, 1, 1 << 30)
    _within("n", n, 0, (1 << 31) - 2)
    return (
        heads,
        n,
        d,
        _address("unit", unit, ("float32",), (heads, n, d)),
        _address("nn_sim", nn_sim, ("float32",), (heads, n), out=True),
        _address("nn_idx", nn_idx, ("int64",), (heads, n), out=True),
    )


def summary_append(unit: Buffer, held: int, block: int, nn_sim: Buffer, nn_idx: Buffer) -> None:
    """bumblebee's streaming append for every KV head (`_summary.c`;
    `_StreamingSummary.append` states the rule), in place: `unit` float32 [H, n, d], the
    summary's `held` members then the batch; `nn_sim` float32 and `nn_idx` int64 [H, n],
    each member's nearest neighbour (the first `held` given, the rest written); `block`:
    rows of cosines per search."""
    heads, n, d, unit_at, sim_at, idx_at = _summary_shape(unit, nn_sim, nn_idx)
    held, block = _within("held", held, 0, n), _within("block", block, 1, 1 << 30)
    _extension("summary").append(unit_at, heads, n, d, held, block, sim_at, idx_at, _vector())


def summary_shrink(
    unit: Buffer,
    count: Buffer,
    mass: Buffer,
    positions: Buffer,
    alive: Buffer,
    nn_sim: Buffer,
    nn_idx: Buffer,
    *,
    budget: int,
    block: int,
    lam: float,
    phi_log: bool,
    alpha: float,
    beta: float,
    minmax: bool,
) -> None:
    """bumblebee's streaming eviction rounds for every KV head (`_summary.c`;
    `_StreamingSummary.shrink` states the rule), in place, down to `budget` live members
    a head: `unit` float32 [H, n, d]; `count` float64 [H, n]; `mass` float64 [H, groups,
    n]; `positions` int64 [H, n]; `alive` bool [H, n]; `nn_sim`, `nn_idx` as
    `summary_append`'s; the objective as `greedy_picks`'."""
    heads, n, d, unit_at, sim_at, idx_at = _summary_shape(unit, nn_sim, nn_idx)
    groups = _within("groups", _dims("mass", mass, "heads, groups, n")[1], 0, 1 << 30)
    _extension("summary").shrink(
        unit_at,
        heads,
        n,
        d,
        groups,
        _address("count", count, ("float64",), (heads, n), out=True),
        _address("mass", mass, ("float64",), (heads, groups, n), out=True),
        _address("positions", positions, ("int64",), (heads, n)),
        _address("alive", alive, ("bool",), (heads, n), out=True),
        sim_at,
        idx_at,
        _within("budget", budget, 0, 1 << 62),
        _within("block", block, 1, 1 << 30),
        float(lam),
        bool(phi_log),
        float(alpha),
        float(beta),
        bool(minmax),
        _vector(),
    )


def farthest_centres(tiles: Buffer, n: int, chosen: Buffer, owner: Buffer | None = None) -> None:
    """subgen's farthest-first (greedy k-center) for every KV head (`_farthest.c`;
    `kvchat.compress._kcenter.farthest_first` states the rule): `tiles` bfloat16 or
    float32 [H, ceil(n / 16), d, 16], each head's n points in tiles of 16 (a last tile's
    unused slots zero); the k centres into `chosen` int64 [H, k] (k <= n) in the order
    chosen; when given, `owner` int64 [H, ceil(n / 16) * 16]: the step whose centre is
    each point's nearest."""
    ext = _extension("farthest")
    heads, count, d, _ = _dims("tiles", tiles, "heads, tiles, d, 16")
    n = _within("n", n, max(1, 16 * count - 15), 16 * count)
    at = _address("tiles", tiles, ("bfloat16", "float32"), (heads, count, d, BLOCK))
    _within("d", d, 1, 1 << 30)
    target = _address("chosen", chosen, ("int64",), (heads, None), out=True)
    k = _within("k (chosen's columns)", chosen.shape[1], 0, n)
    owner_at = 0 if owner is None else _address("owner", owner, ("int64",), (heads, 16 * count), out=True)
    ext.farthest(at, _dtype(tiles) == "bfloat16", heads, n, d, k, target, owner_at, _vector())
