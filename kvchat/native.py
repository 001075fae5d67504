"""kvchat's own compiled kernels for the recall tier (`kvchat/_coldrank.c`: its ranking and
row reads), where the install could build them: `pip install` compiles the C file when a
C compiler is there (pyproject.toml) and goes on without it when not; every caller then
takes its PyTorch path. (bumblebee's greedy kernel, `kvchat/compress/_greedy.c`, is the
compressor's own: a compressor imports nothing outside `kvchat.compress`.)"""

from __future__ import annotations

from types import ModuleType

coldrank: ModuleType | None
try:
    from . import _coldrank as coldrank
except ImportError:  # not built: no compiler at install time
    coldrank = None

# False sends every caller to its PyTorch path (the benchmarks' side-by-side runs; the
# layout of a key index is chosen when its tier is made, `kvchat.keyindex.key_index`).
ENABLED = True


def available() -> bool:
    """Whether the recall kernels are built (and not turned off)."""
    return ENABLED and coldrank is not None



def vnni() -> bool:
    """Whether the ranking kernel's vector path runs here: AVX512-VNNI (x86-64)."""
    return available() and bool(coldrank.vnni())  # type: ignore[union-attr]
