"""`kvchat bench SUITE`: the benchmarks (`kvchat.bench`), and `summary`, which writes
docs/benchmarks.md from the latest reports."""

from __future__ import annotations

import argparse

from kvchat.cli.options import bench_options


def cmd_bench(args: argparse.Namespace) -> int:
    from kvchat import bench

    if args.suite == "summary":
        from kvchat.bench import summary

        return summary.main([] if args.out is None else ["--bench", args.out])
    return bench.run(bench_options(args))
