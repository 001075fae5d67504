"""Whole-process start of `kvchat ask "Say hi." --no-save` under several set-ups (venvs),
side by side: each round runs every arm once, in turn.

An arm is `name=VENV` (the venv's own `bin/kvchat`, the checkout it was installed from)
or `name=VENV:nopyc`: before each run the checkout's `kvchat/**/__pycache__` is removed,
so the run compiles kvchat's source, as every start does where PYTHONDONTWRITEBYTECODE
is set (as in this sandbox) and as a first start does elsewhere. An arm without `:nopyc`
compiles the checkout's bytecode first (`compileall`, as `make setup` now does).

    python docs/bench/startup/setups.py before=/tmp/ab-sys/.venv:nopyc \
        isolated=/work/main/.venv:nopyc after=/work/main/.venv --rounds 10 \
        --home /work/main --out docs/bench/startup/results-setups.json
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench import alternate, arguments, write  # noqa: E402

ARGS = ["ask", "Say hi.", "--no-save"]


def checkout_of(venv: Path) -> Path:
    """The source folder of the venv's editable kvchat install."""
    python = venv / "bin" / "python"
    out = subprocess.run([str(python), "-c", "import kvchat, pathlib; print(pathlib.Path(kvchat.__file__).parent)"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def prepare(venv: Path, compiled: bool) -> None:
    package = checkout_of(venv)
    if compiled:
        subprocess.run([str(venv / "bin" / "python"), "-m", "compileall", "-q", str(package)], check=True)
    else:
        for cache in package.rglob("__pycache__"):
            shutil.rmtree(cache)


def run(venv: Path, home: str, cwd: str) -> tuple[float, str]:
    env = {**os.environ, "KVCHAT_HOME": home}
    env.pop("OMP_NUM_THREADS", None)  # kvchat picks its own thread count, as for a user
    start = time.perf_counter()
    done = subprocess.run([str(venv / "bin" / "kvchat"), *ARGS], check=False, cwd=cwd, env=env,
                          capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{venv}: exit {done.returncode}\n{done.stderr}")
    return elapsed, done.stdout.strip()


def main() -> None:
    args = arguments(__doc__, "arms", "name=VENV or name=VENV:nopyc", rounds=10)
    arms: dict[str, tuple[Path, bool]] = {}
    for arm in args.arms:
        name, spec = arm.split("=", 1)
        path, _, flag = spec.partition(":")
        arms[name] = (Path(path), flag != "nopyc")
    cwd = tempfile.mkdtemp(prefix="kvchat-bench-cwd-")
    for name, (venv, compiled) in arms.items():  # untimed: converted copy and weight cache
        prepare(venv, compiled)
        print(f"warm-up {name}: {run(venv, args.home, cwd)[0]:.2f} s", flush=True)

    def timed(venv: Path, compiled: bool) -> tuple[float, str]:
        prepare(venv, compiled)
        return run(venv, args.home, cwd)

    runs = {name: functools.partial(timed, venv, compiled) for name, (venv, compiled) in arms.items()}
    write({
        "command": "VENV/bin/kvchat " + " ".join(ARGS[:1]) + ' "Say hi." --no-save',
        "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE"),
        "rounds": args.rounds,
        "arms": {name: {"venv": str(venv), "kvchat_bytecode": compiled} for name, (venv, compiled) in arms.items()},
        **alternate(runs, args.rounds),
    }, args.out)

if __name__ == "__main__":
    main()
