"""Benchmark reports: one JSON file, one markdown table and PNG plots per suite.

Every report names what made it: the commit of the checkout (`commit`), the command line as
typed and the environment variables that change what is measured (`command_line`,
`environment`), kvchat's version, and the machine with its CPU (`machine`, `cpu`)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import kvchat

# The kvchat package folder: its checkout is the one whose commit a report names.
PACKAGE = Path(kvchat.__file__).resolve().parent
# CPU flags that decide kvchat's paths: bf16 compute, the recall kernel's VNNI and AVX2 paths.
CPU_FLAGS = ("avx2", "avx512_bf16", "avx512_vnni")
# Environment variables that change what a run measures, recorded with its command line
# (KVCHAT_HOME and KVCHAT_CONFIG name folders, not settings, and are left out).
MEASURED_ENVIRONMENT = ("KVCHAT_KERNELS", "KVCHAT_BENCH_NO_RECOMPUTE", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
NOT_RECORDED = "not recorded"


def _git(folder: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, timeout=10, check=True)
    return done.stdout.strip()


def commit(package: Path = PACKAGE) -> str:
    """The short hash of the checkout `package` sits at the top of, with "+dirty" when files
    other than documentation (docs/, *.md: where the reports go) have uncommitted changes;
    "unknown" outside a checkout or without git."""
    try:
        top = Path(_git(package, "rev-parse", "--show-toplevel")).resolve()
        if (top / package.name).resolve() != package.resolve():
            return "unknown"  # an installed copy inside some other repository
        head = _git(top, "rev-parse", "--short", "HEAD")
        changed = _git(top, "status", "--porcelain", "--", ".", ":(exclude)docs", ":(exclude)*.md")
    except (OSError, subprocess.SubprocessError, ValueError):
        return "unknown"
    return f"{head}+dirty" if changed else head


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed: `kvchat bench speed ...` (also when run as `python -m kvchat`)."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return "unknown"
    program = Path(argv[0])
    name = "kvchat" if program.name == "kvchat" or program.parent.name == "kvchat" else program.name
    return shlex.join([name, *argv[1:]])


def environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of `MEASURED_ENVIRONMENT` that are set."""
    env = os.environ if env is None else env
    return {name: env[name] for name in MEASURED_ENVIRONMENT if name in env}


def as_typed(report: dict[str, Any]) -> str:
    """A report's command line with its environment in front, as a shell takes it; "not
    recorded" for a report written before reports named their command."""
    if not report.get("command"):
        return NOT_RECORDED
    variables = report.get("environment") or {}
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in variables.items()), report["command"]])


def cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The CPU's model name and which of `CPU_FLAGS` and the AMX flags it has (None where
    /proc/cpuinfo cannot be read)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return {"model": platform.processor() or platform.machine(), "flags": None}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's
    flags = fields.get("flags", fields.get("Features", "")).split()
    wanted = [f for f in CPU_FLAGS if f in flags] + sorted(f for f in flags if f.startswith("amx"))
    model = fields.get("model name") or fields.get("Model") or platform.processor() or platform.machine()
    return {"model": model, "flags": wanted}


def machine() -> dict[str, Any]:
    """What the numbers were measured on (quote it with them)."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    with contextlib.suppress(OSError):
        info["load_avg_1m"] = os.getloadavg()[0]
    return info


def provenance() -> dict[str, Any]:
    """What made a report: commit, command line, environment and kvchat's version."""
    return {
        "commit": commit(),
        "command": command_line(),
        "environment": environment(),
        "kvchat_version": kvchat.__version__,
    }


def describe_machine(meta: dict[str, Any]) -> str:
    """One line for a report's `machine`: the CPU with its flags (the processor's name in
    reports written before they named the CPU), the cores, torch, the GPU, the date."""
    processor = meta.get("cpu") or {"model": meta.get("processor", "unknown"), "flags": None}
    flags = processor.get("flags")
    name = processor["model"] + (f" ({', '.join(flags) or 'no avx2'})" if flags is not None else "")
    cuda = f", {meta['cuda']}" if meta.get("cuda") else ""
    return f"{name}, {meta.get('cpus')} CPUs, torch {meta.get('torch')}{cuda}; {meta.get('date')}"


def header(report: dict[str, Any]) -> list[str]:
    """The markdown lines under a report's title: machine, commit and command."""
    version = f", kvchat {report['kvchat_version']}" if report.get("kvchat_version") else ""
    return [
        f"Machine: {describe_machine(report.get('machine', {}))}.",
        "",
        f"Commit: {report.get('commit') or NOT_RECORDED}{version}. Command: "
        + (f"`{as_typed(report)}`." if report.get("command") else f"{NOT_RECORDED}."),
    ]


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write(
    out: str | Path,
    suite: str,
    rows: list[dict[str, Any]],
    columns: list[str],
    *,
    title: str,
    notes: str = "",
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write `<suite>.json` and `<suite>.md` under `out`; returns the folder."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    data = {"suite": suite, **provenance(), "machine": machine(), "rows": rows, **(extra or {})}
    (folder / f"{suite}.json").write_text(json.dumps(data, indent=1))
    md = [f"# {title}", "", *header(data), ""]
    if notes:
        md += [notes, ""]
    md += [markdown_table(rows, columns), ""]
    (folder / f"{suite}.md").write_text("\n".join(md))
    return folder


def plot(
    out: str | Path,
    name: str,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
) -> Path:
    """A line plot, one line per series label -> (xs, ys)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(out) / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
