"""kvchat's own compiled kernels for the recall tier (`kvchat/native/_coldrank.c`: its ranking and
row reads), where the install could build them: `pip install` compiles the C file when a
C compiler is there (pyproject.toml) and goes on without it when not; every caller then
takes its PyTorch path. (The compressors' kernels, `kvchat/compress/_*.c`, are theirs: a
compressor imports nothing outside `kvchat.compress`.)"""

from __future__ import annotations

import functools
from types import ModuleType

coldrank: ModuleType | None
try:
    from kvchat.native import _coldrank as coldrank
except ImportError:  # not built: no compiler at install time
    coldrank = None

# False sends every caller to its PyTorch path (the benchmarks' side-by-side runs; the
# layout of a key index is chosen when its tier is made, `kvchat.recall.key_index.key_index`).
ENABLED = True


def available() -> bool:
    """Whether the recall kernels are built (and not turned off)."""
    return ENABLED and coldrank is not None


# The ranking kernel's paths by the number its calls take, fastest first.
PATHS = {"vnni": 2, "avx2": 1, "scalar": 0}
# None: the fastest path this CPU runs; a name of PATHS: that one (the benchmarks' A/B).
FORCE_PATH: str | None = None


def ranking_path() -> str | None:
    """The ranking kernel's path here: "vnni" (AVX512-VNNI), "avx2" (AVX2 and FMA), or None
    where it does not run (not built, turned off, or a CPU with neither: the PyTorch
    layouts of `kvchat.recall.key_index` serve it then)."""
    if not available():
        return None
    return FORCE_PATH if FORCE_PATH is not None else _fastest_path()


@functools.cache
def _fastest_path() -> str | None:
    # (asked once: every recalling layer of every pass passes the path to the kernel)
    if coldrank.vnni():  # type: ignore[union-attr]
        return "vnni"
    return "avx2" if coldrank.avx2() else None  # type: ignore[union-attr]


def path_number() -> int:
    """`ranking_path()` as the number the kernel's calls take (the plain loop where none)."""
    return PATHS[ranking_path() or "scalar"]
