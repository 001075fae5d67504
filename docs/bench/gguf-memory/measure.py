"""Peak memory and time of a first start on a GGUF model: kvchat at a base commit (the
GGUF converted whole in memory by transformers, the int8 weights quantised from the whole
model) against kvchat at HEAD (the copy and the int8 cache written tensor by tensor).

    PYTHONPATH=. python docs/bench/gguf-memory/measure.py --base 97cb195 --repeat 2

Builds a synthetic Llama GGUF of about 1B parameters under --work (hidden 2048, 16
layers, FFN 8192, 32 query heads and 8 KV heads, a 32,000-token vocabulary, the output
layer tied to the embedding; random weights stored Q8_0 by gguf-py, norms F32). Exports
kvchat at --base and at HEAD with `git archive` (the C kernels are not built in either:
loading does not use them), then runs every first start, `load_model(GGUF, dtype=D)` for
D in float32 and int8, in a child process of its own with an empty data home, and
records:

- max RSS: the child's `ru_maxrss` (resident pages at the peak, file-backed pages of
  memory-mapped files included: those the kernel can drop and read again);
- peak anonymous memory: the child's RssAnon (/proc/PID/status), sampled every 10 ms;
- the time `load_model` took (conversion, quantisation and load), and the bytes the
  data home holds after it.

Every data home is deleted after its run, and the GGUF and the exports at the end
(unless --keep). The report (JSON and markdown, with the commit, command and machine)
goes to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from io import BytesIO
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[3]
# (what the row is called, --dtype, whether the data home starts empty)
STARTS = [
    ("first, float32 (converts)", "float32", False),
    ("int8 from the copy (quantises)", "int8", False),
    ("first, int8 (converts, quantises)", "int8", True),
]
SHAPE = {"vocab": 32000, "hidden": 2048, "layers": 16, "ffn": 8192, "heads": 32, "kv_heads": 8}

CHILD = """
import json, sys, time
start = time.perf_counter()
import kvchat
from kvchat.model.loading import load_model
imported = time.perf_counter()
loaded = load_model(sys.argv[1], device="cpu", dtype=sys.argv[2])
done = time.perf_counter()
print(json.dumps({"import_s": imported - start, "load_s": done - imported, "precision": loaded.precision,
                  "kvchat": kvchat.__file__}))
"""


def build_gguf(path: Path, seed: int = 0) -> dict:
    """The synthetic model, written one tensor at a time (the writer holds no weights)."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    vocab, hidden, layers, ffn = SHAPE["vocab"], SHAPE["hidden"], SHAPE["layers"], SHAPE["ffn"]
    heads, kv_heads = SHAPE["heads"], SHAPE["kv_heads"]
    head_dim = hidden // heads
    q8 = GGMLQuantizationType.Q8_0
    f32 = GGMLQuantizationType.F32
    tensors = [("token_embd.weight", (vocab, hidden), q8)]
    for i in range(layers):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (hidden,), f32),
            (f"blk.{i}.attn_q.weight", (hidden, hidden), q8),
            (f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden), q8),
            (f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden), q8),
            (f"blk.{i}.attn_output.weight", (hidden, hidden), q8),
            (f"blk.{i}.ffn_norm.weight", (hidden,), f32),
            (f"blk.{i}.ffn_gate.weight", (ffn, hidden), q8),
            (f"blk.{i}.ffn_up.weight", (ffn, hidden), q8),
            (f"blk.{i}.ffn_down.weight", (hidden, ffn), q8),
        ]
    tensors.append(("output_norm.weight", (hidden,), f32))

    started = time.perf_counter()
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("synthetic-1b")
    writer.add_block_count(layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_file_type(7)  # mostly Q8_0
    # A byte-level BPE vocabulary transformers can build a tokenizer from: printable
    # ASCII, then fillers up to the size.
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(c) for c in range(33, 127)] + [f"t{i}" for i in range(vocab - 94)])
    writer.add_token_merges(["t 0"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    for name, shape, kind in tensors:
        elements = int(np.prod(shape))
        nbytes = elements * 4 if kind == f32 else elements // 32 * 34
        writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    parameters = 0
    for _, shape, kind in tensors:
        if kind == f32:
            writer.write_tensor_data(np.ones(shape, dtype=np.float32))
        else:
            weights = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
            writer.write_tensor_data(quants.quantize(weights, kind))
            del weights
        parameters += int(np.prod(shape))
    writer.close()
    return {
        "parameters": parameters,
        "gguf_bytes": path.stat().st_size,
        "build_s": round(time.perf_counter() - started, 1),
        **SHAPE,
        "stored": "Q8_0 (norms F32)",
    }


def export(commit: str, into: Path) -> str:
    """kvchat's package at `commit` under `into`; the commit's short hash."""
    short = subprocess.run(
        ["git", "rev-parse", "--short", commit], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit, "kvchat"], cwd=REPO, capture_output=True, check=True
    )
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return short


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def run_start(code: Path, gguf: Path, dtype: str, home: Path, log: Path) -> dict:
    """One first start in a child process: its peaks, its time, what it left on disk."""
    home.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(code),
        "KVCHAT_HOME": str(home),
        "KVCHAT_CONFIG": str(home / "no-config.toml"),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    started = time.perf_counter()
    with log.open("w") as err, (home / "child.out").open("w") as out:
        # Run from the export: `python -c` puts its folder first on sys.path, ahead of an
        # editable install of kvchat (and of the checkout the parent runs from).
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(gguf), dtype], cwd=code, env=env, stdout=out, stderr=err
        )
        peak_anon = 0
        while True:
            # wait4 (not Popen.wait): the child's own rusage, max RSS included
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            try:
                for line in Path(f"/proc/{child.pid}/status").read_text().splitlines():
                    if line.startswith("RssAnon:"):
                        peak_anon = max(peak_anon, int(line.split()[1]) * 1024)
            except (OSError, ValueError):
                pass
            time.sleep(0.01)
        child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if child.returncode != 0:
        raise SystemExit(f"the {dtype} start failed ({child.returncode}); see {log}")
    result = json.loads((home / "child.out").read_text().strip().splitlines()[-1])
    if not Path(result["kvchat"]).is_relative_to(code):
        raise SystemExit(f"the child ran kvchat from {result['kvchat']}, not from {code}")
    return {
        "max_rss_gib": round(usage.ru_maxrss * 1024 / 2**30, 2),
        "peak_anon_gib": round(peak_anon / 2**30, 2),
        "load_s": round(result["load_s"], 1),
        "process_s": round(wall, 1),
        "precision": result["precision"],
        "data_home_gib": round(folder_bytes(home / "models") / 2**30, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare against (kvchat before the stream)")
    parser.add_argument("--work", default="/tmp/gguf-memory", help="where the GGUF, exports and data homes go")
    parser.add_argument("--out", default=str(Path(__file__).parent), help="where the report goes")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the GGUF and the exports")
    parser.add_argument("--quick", action="store_true", help="a 2-layer model of width 256 (smoke runs)")
    args = parser.parse_args(argv)
    if args.quick:
        SHAPE.update(hidden=256, layers=2, ffn=512, heads=4, kv_heads=2)

    from kvchat.bench import report

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    gguf = work / "synthetic-1b.Q8_0.gguf"
    model = build_gguf(gguf)
    print(json.dumps(model), flush=True)
    codes = {"base": work / "code-base", "head": work / "code-head"}
    commits = {"base": export(args.base, codes["base"]), "head": export("HEAD", codes["head"])}
    rows = []
    try:
        for run in range(1, args.repeat + 1):
            # A first float32 start converts; an int8 start in the same data home then
            # finds the copy and only quantises; a first int8 start does both. Before and
            # after take turns, so that what else runs on the box weighs on both alike.
            shared = {which: work / f"home-{which}-{run}" for which in codes}
            for start, dtype, fresh in STARTS:
                for which in codes:
                    home = work / f"home-{which}-{run}-fresh" if fresh else shared[which]
                    if fresh:
                        shutil.rmtree(home, ignore_errors=True)
                    load = round(os.getloadavg()[0], 2)  # what else ran: the box is shared
                    try:
                        row = run_start(codes[which], gguf, dtype, home, work / f"{which}-{dtype}-{run}.log")
                    finally:
                        if fresh:
                            shutil.rmtree(home, ignore_errors=True)
                    row = {"run": run, "kvchat": f"{which} ({commits[which]})", "start": start, **row, "load_1m": load}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
            for home in shared.values():
                shutil.rmtree(home, ignore_errors=True)
    finally:
        if not args.keep:
            gguf.unlink(missing_ok=True)
            for folder in codes.values():
                shutil.rmtree(folder, ignore_errors=True)
    columns = [
        "run",
        "kvchat",
        "start",
        "max_rss_gib",
        "peak_anon_gib",
        "load_s",
        "process_s",
        "data_home_gib",
        "load_1m",
    ]
    notes = (
        f"Starts (`load_model(GGUF, dtype=...)`) on a synthetic Llama GGUF of "
        f"{model['parameters'] / 1e9:.2f}B parameters ({model['gguf_bytes'] / 2**30:.2f} GiB, {model['stored']}), "
        "each in a child process of its own: a first float32 start (an empty data home: it converts), an int8 "
        "start in the same data home (the copy is there: it quantises), a first int8 start (both). max RSS counts memory-mapped file pages too; peak anon is "
        "RssAnon sampled every 10 ms. load_s: conversion, quantisation and load; process_s: the child's wall "
        "time, imports included; load_1m: the 1-minute load average as the run began (2 cores)."
    )
    report.write(
        args.out,
        "gguf-memory",
        rows,
        columns,
        title="First start on a 1B-parameter GGUF: peak memory and time",
        notes=notes,
        extra={"model": model, "commits": commits},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
