"""Which prefill queries score-based methods (h2o, bumblebee) take their attention mass
from, on the fast path, now that the blocked kernel holds every probability: every query
(stride 1) or every 2nd, 4th, 8th (the chunk's last always taken, scaled to the chunk).

Per stride: next-token KL against the full cache, as `kvchat bench fidelity` scores it
(`score_document`: a held exact prefill collecting mass, forked to each method, then
SCORED teacher-forced tokens), and the time to first token of a 6k document under h2o.

    .venv/bin/python docs/bench/ttft/stride.py     # writes stride.json / stride.md here
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
STRIDES = (1, 2, 4, 8)
CONTEXT, SCORED, DOCUMENTS, BUDGET = 2048, 128, 2, "25%"
TTFT_CONTEXT = 6144


def main() -> None:
    import kvchat.layer as layer
    from kvchat.bench import report
    from kvchat.bench.fidelity import Row, essay_ids, score_document, spread
    from kvchat.engine import load_engine
    from kvchat.settings import BenchOptions, CacheSettings, ModelOptions

    engine = load_engine(ModelOptions())
    options = BenchOptions(suite="fidelity")
    ids = essay_ids(engine)
    documents = spread(ids, DOCUMENTS, CONTEXT + SCORED)
    rows_out = []
    reference: list[torch.Tensor | None] = [None] * DOCUMENTS
    for stride in STRIDES:
        layer.BLOCKED_MASS_STRIDE = stride  # read when each layer is made
        kl: dict[str, list[float]] = {"h2o": [], "bumblebee": []}
        for i, doc in enumerate(documents):
            rows = [Row("full", "full", {}), Row("h2o", "h2o", {}), Row("bumblebee", "bumblebee", {})]
            result, reference[i] = score_document(engine, rows, doc[:CONTEXT], doc[CONTEXT:], BUDGET, options,
                                                  reference[i])
            for name in kl:
                kl[name].extend(result[name]["kl"])
        session = engine.new_session(CacheSettings(method="h2o", budget="1024"))
        assert session.cache.mass_stride == stride
        wall = time.perf_counter()
        session.feed(ids[:TTFT_CONTEXT])
        ttft = time.perf_counter() - wall
        row = {"stride": stride, "kl_h2o": statistics.mean(kl["h2o"]), "kl_bumblebee": statistics.mean(kl["bumblebee"]),
               "ttft_h2o_6k_s": ttft, "load1": float(Path("/proc/loadavg").read_text().split()[0]),
               "threads": torch.get_num_threads()}
        rows_out.append(row)
        print(row, flush=True)
    report.write(HERE, "stride", rows_out, ["stride", "kl_h2o", "kl_bumblebee", "ttft_h2o_6k_s", "load1", "threads"],
                 title=f"Prefill mass from every stride-th query ({engine.loaded.precision}, blocked kernel)",
                 notes=f"KL(full || method) per predicted token, mean over {DOCUMENTS} essay documents of {CONTEXT} "
                       f"tokens + {SCORED} scored, budget {BUDGET} (bench fidelity's scoring); ttft: a "
                       f"{TTFT_CONTEXT}-token document under h2o, budget 1024, one run per stride on a shared box.")


if __name__ == "__main__":
    main()
