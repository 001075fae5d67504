"""`kvchat bench speed`: what a user feels, measured side by side in one run.

Parts (`--parts`, default all):
- `start`: a whole `kvchat ask "Say hi." --no-save` process, wall time (best of 3);
- `methods`: per method and context (256, 2k, 6k, 8k), time to first token of a
  document read in one message (prefill + compression + first token), then decode
  tokens/s over 128 forced greedy tokens (two eviction batches: the steady state, see
  `DECODE_TOKENS`), then the time to first token of a later turn (a short question as the
  next user message, `NEXT_TURN_QUESTION`, with the document and that answer in the cache);
  beside them plain transformers `generate` with float32 weights (the reference every ratio
  is quoted against) and, when llama-cpp-python is installed, llama.cpp on the same GGUF
  file. `--recall N,M` adds a row per method and value after the method's own,
  "method+recallN": the same measure with the recall tier (N cold tokens per KV head and
  step), and its ratios to the method without it (`decode_vs_method`, `ttft_vs_method`,
  `next_turn_vs_method`); the method and its recall rows are then measured in rounds in
  turn, medians of three (`_paired`);
- `mass`: score-based methods with the prefill attention mass from every 2nd, 4th and 8th
  query against every query (the fast path's default, `layer.BLOCKED_MASS_STRIDE`): time
  to first token and how much the kept set changes;
- `threads`: decode under one CPU-bound competing process, with the thread governor and
  with a fixed 2 threads, against the idle single-thread speed;
- `agreement`: greedy tokens of the configured weight path against float32, over 20
  prompts (the fidelity of the fast path);
- `kernels` (only when named): the `methods` part with kvchat's compiled kernels on and
  with `KVCHAT_KERNELS=off`, each side a new process, in rounds of alternating order, and
  their ratios (`kernels.py`).
"""

from __future__ import annotations

import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kvchat.bench import report
from kvchat.settings import DEFAULT_BATCH, BenchOptions, parse_recall

# Decode steps measured after the document: a whole number of eviction batches. The
# cache streams window overflow into the compressor once per `DEFAULT_BATCH` (64) steps,
# in every layer at the same step, so a run covering k batches catches exactly k
# ingests per layer: the steady state. (A run of 32 steps would catch one ingest per layer
# in half a batch of steps, and so count compression about twice.)
DECODE_TOKENS = 2 * DEFAULT_BATCH
# Tokens of each answer in the `agreement` part.
AGREEMENT_TOKENS = 32
CONTEXTS = [256, 2048, 6144, 8192]
TTFT_CONTEXTS = {2048, 6144}
PARTS = ["start", "methods", "mass", "threads", "agreement"]
# Parts run only when named: `kernels` runs the methods part twice in new processes.
NAMED_PARTS = ["kernels"]
# Prefill mass strides the `mass` part compares with every query (stride 1).
MASS_STRIDES = (1, 2, 4, 8)
# The later turn whose time to first token `_ours` measures after the decode steps, and
# the positions kept free for it (its ids are the chat template's end of the answer, this
# question as a user message and the assistant's header: about 20 tokens).
NEXT_TURN_QUESTION = "What is the main point of the text above?"
NEXT_TURN_ROOM = 32
# Rounds in turn of a method and its recall rows (`_paired`).
PAIRED_ROUNDS = 3


def _prompt_ids(engine, length: int) -> list[int]:
    from kvchat.calibration.realkv import essays_text

    ids = engine.tokenizer(essays_text(), add_special_tokens=False).input_ids
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def _fits(engine, length: int) -> int:
    """Every method is measured at the same length, as close to `length` as fits the
    trained positions with the new tokens and the later turn (8k -> 8,031): the exact
    cache cannot go further, and the others would re-rotate their keys inside the
    measured steps."""
    return min(length, engine.loaded.max_positions - DECODE_TOKENS - NEXT_TURN_ROOM - 1)


def next_turn_ids(session, answer_ids: list[int], question: str = NEXT_TURN_QUESTION) -> list[int]:
    """The ids the app feeds for `question` as the next user message after an answer of
    `answer_ids` (`ChatSession.prompt_ids`: the rendered conversation minus what was fed):
    the chat template's end of the answer, the user message and the assistant's header.
    The document before the answer stands as a placeholder message, since what a later
    turn feeds depends only on the conversation's end."""
    document = "(the document)"
    first = session.prompt_ids(document, history=([], []))
    answer = session.engine.tokenizer.decode(answer_ids, skip_special_tokens=False)
    messages = [{"role": "user", "content": document}, {"role": "assistant", "content": answer}]
    return session.prompt_ids(question, history=(messages, first + list(answer_ids)))


@torch.inference_mode()
def _ours(
    engine, ids: list[int], settings, new_tokens: int = DECODE_TOKENS, next_turn: bool = True
) -> dict[str, float]:
    """Feed `ids` as a document (exact-then-compress when it fits, as the app does), take
    the first token, then decode `new_tokens` forced greedy steps. With `next_turn`, then
    feed a later turn (`next_turn_ids`: a short question after that answer, through the
    session's `feed` as a turn of the app is) and time it to its first token."""
    session, token, ttft, mode = _prefilled(engine, ids, settings)
    return {
        "ttft_s": ttft,
        "prefill_tok_s": len(ids) / ttft,
        "prefill_mode": mode,
        **_after_prefill(engine, session, token, new_tokens, next_turn),
    }


def _prefilled(engine, ids: list[int], settings):
    """A new session that has read `ids` as a document: (session, its first token, the
    time to it, the prefill mode)."""
    session = engine.new_session(settings)
    start = time.perf_counter()
    logits, mode = session.feed(ids)
    token = int(torch.argmax(logits))
    return session, token, time.perf_counter() - start, mode


@torch.inference_mode()
def _after_prefill(engine, session, token: int, new_tokens: int, next_turn: bool) -> dict[str, float]:
    """`_ours` from the first token on: decode, then (with `next_turn`) a later turn."""
    compress_before = session.cache.compress_seconds
    answer = []
    start = time.perf_counter()
    for _ in range(new_tokens):
        answer.append(token)
        logits = engine.forward([token], session.cache)
        token = int(torch.argmax(logits))
    decode_s = time.perf_counter() - start
    result = {
        "decode_tok_s": new_tokens / decode_s,
        "compress_share": (session.cache.compress_seconds - compress_before) / decode_s,
        "kv_mb": session.cache.nbytes() / 2**20,
        "entries_per_head": session.cache.entries_per_head(),
    }
    if next_turn:
        follow_up = next_turn_ids(session, answer)
        start = time.perf_counter()
        logits, _ = session.feed(follow_up)
        int(torch.argmax(logits))
        result["next_turn_ttft_s"] = time.perf_counter() - start
        result["next_turn_tokens"] = len(follow_up)
    return result


def _paired(engine, ids: list[int], settings: list, new_tokens: int, rounds: int = PAIRED_ROUNDS) -> list[dict]:
    """`_ours` for several settings on one document, measured side by side: each is
    prefilled once (its time to first token), then `rounds` rounds take each in turn,
    from a fork of its prefilled session, through the decode steps and the later turn;
    decode speed and the later turn's time are the medians of the rounds. On a shared box
    one decode run of a pair can swing by 0.2x; rounds in turn share the box's moods, and
    the median drops a round that caught a burst of other work."""
    prefilled = [_prefilled(engine, ids, s) for s in settings]
    runs: list[list[dict[str, float]]] = [[] for _ in settings]
    for _ in range(rounds):
        for (session, token, _ttft, _mode), done in zip(prefilled, runs):
            done.append(_after_prefill(engine, session.fork(), token, new_tokens, next_turn=True))
    results = []
    for (_session, _token, ttft, mode), done in zip(prefilled, runs):
        median = {key: statistics.median(run[key] for run in done) for key in ("decode_tok_s", "next_turn_ttft_s")}
        results.append(
            {
                "ttft_s": ttft,
                "prefill_tok_s": len(ids) / ttft,
                "prefill_mode": mode,
                **done[-1],
                **median,
                "rounds": rounds,
            }
        )
    return results


class _TokenClock:
    """A `generate` streamer that notes when each new token arrives (its first `put`
    is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


@torch.inference_mode()
def _generate(model, ids: list[int], new_tokens: int = DECODE_TOKENS) -> dict[str, float]:
    """Plain transformers `generate` (its own cache, SDPA attention): time to first
    token, then decode tokens/s, both from one call (a streamer notes each token's
    arrival; two separate calls subtracted can go negative on a busy machine)."""
    inputs = torch.tensor([ids], device=model.device)
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    clock = _TokenClock()
    try:
        start = time.perf_counter()
        model.generate(
            inputs, max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, do_sample=False, streamer=clock
        )
    finally:
        model.set_attn_implementation(previous)
    first = clock.times[0] - start
    decode = clock.times[-1] - clock.times[0]
    return {"ttft_s": first, "prefill_tok_s": len(ids) / first, "decode_tok_s": (len(clock.times) - 1) / decode}


def _llama_cpp(gguf: str | None, ids_text: str, context: int, threads: int) -> dict[str, float] | None:
    """llama.cpp (llama-cpp-python) on the same GGUF file, when that package is installed
    (it is never a dependency of kvchat)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    if gguf is None:
        return None
    llm = Llama(model_path=gguf, n_ctx=context + DECODE_TOKENS + 64, n_threads=threads, verbose=False)
    tokens = llm.tokenize(ids_text.encode(), add_bos=False)[:context]
    start = time.perf_counter()
    llm.eval(tokens)
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        llm.eval([llm.sample(temp=0.0)])
    decode_s = time.perf_counter() - start
    return {"ttft_s": ttft, "prefill_tok_s": len(tokens) / ttft, "decode_tok_s": DECODE_TOKENS / decode_s}


def _exact_model(engine, model_path: str | None):
    """The float32 reference model (the engine's own when it already runs float32)."""
    from kvchat.model.loading import load_model

    if engine.loaded.precision == "float32":
        return engine.model
    return load_model(model_path, device="cpu", dtype="float32").model


# -- parts ---------------------------------------------------------------------------------
def first_frame_s(model_path: str | None, db: str, timeout: float = 60.0, checkout: Path | None = None) -> float | None:
    """Seconds from launching `kvchat` in a real terminal (a private tmux server) to its
    first frame: the app drawn with its status bar, the model still loading. None when
    tmux is not installed. `checkout`: run the kvchat of that source tree instead (a
    worktree of another commit, for a side-by-side comparison)."""
    if shutil.which("tmux") is None:
        return None
    socket = f"kvchat-bench-{uuid.uuid4().hex[:8]}"
    tmux = ["tmux", "-L", socket]
    command = f"{shlex.quote(sys.executable)} -m kvchat --db {shlex.quote(db)}"
    env = None
    if checkout is not None:
        command = f"cd {shlex.quote(str(checkout))} && {command}"
        env = {**os.environ, "PYTHONPATH": str(checkout)}
    if model_path:
        command += f" --model {shlex.quote(model_path)}"
    try:
        start = time.perf_counter()
        subprocess.run(
            [*tmux, "new-session", "-d", "-s", "app", "-x", "110", "-y", "34", "-e", "TERM=xterm-256color", command],
            check=True,
            env=env,
        )
        while time.perf_counter() - start < timeout:
            screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", "app"], capture_output=True, text=True).stdout
            if "│" in screen and ("loading model" in screen or "ready" in screen):
                return time.perf_counter() - start
            time.sleep(0.01)
        raise RuntimeError(f"kvchat drew no frame within {timeout:.0f} s")
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


def part_start(model_path: str | None, repeats: int = 3) -> list[dict[str, Any]]:
    rows = []
    frames = []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(repeats):
            seconds = first_frame_s(model_path, str(Path(folder) / f"frame{i}.db"))
            if seconds is not None:
                frames.append(seconds)
    if frames:
        rows.append(
            {
                "what": "kvchat in a terminal (tmux): launch to first frame",
                "best_s": min(frames),
                "median_s": statistics.median(frames),
                "runs": len(frames),
            }
        )
        print(rows[-1], flush=True)
    command = [sys.executable, "-m", "kvchat", "ask", "Say hi.", "--no-save", "--max-new-tokens", "16"]
    if model_path:
        command += ["--model", model_path]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        times.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise RuntimeError(f"kvchat ask failed: {done.stderr.strip()[-300:]}")
    row = {
        "what": 'kvchat ask "Say hi." --no-save (whole process)',
        "best_s": min(times),
        "median_s": statistics.median(times),
        "runs": repeats,
    }
    print(row, flush=True)
    return rows + [row]


def _given_params(method_params: dict[str, dict[str, Any]]) -> str:
    """The hyperparameters given on the command line, for a report's title ("" for none)."""
    given = [f"{method} {param}={value}" for method, params in method_params.items() for param, value in params.items()]
    return "; " + ", ".join(given) if given else ""


def part_methods(
    engine,
    exact_model,
    methods: list[str],
    contexts: list[int],
    budget: str,
    gguf: str | None,
    recall: list[int] | None = None,
    *,
    settings=None,
    method_params: dict[str, dict[str, Any]] | None = None,
    new_tokens: int = DECODE_TOKENS,
) -> list[dict[str, Any]]:
    """Rows per context: `generate`, every method, then (for each value N > 0 of `recall`)
    the method again with the recall tier, "method+recallN", with its ratios to the method.
    `settings`: the cache settings every row starts from (method, budget and recall
    replaced; default `CacheSettings()`); `method_params`: each method's hyperparameters
    ({method: {param: value}}; None: `settings`' own params for every method);
    `new_tokens`: decode steps measured."""
    from kvchat.settings import CacheSettings

    base = settings or CacheSettings()

    def cache(method: str, n: int = 0, **changes) -> CacheSettings:
        params = base.params if method_params is None else method_params.get(method, {})
        return replace(base, params=dict(params), method=method, budget=budget, recall=n, **changes)

    recall = [n for n in dict.fromkeys(recall or ()) if n > 0]
    rows: list[dict[str, Any]] = []
    for length in contexts:
        context = _fits(engine, length)
        ids = _prompt_ids(engine, context)
        ref = _generate(exact_model, ids, new_tokens)
        rows.append({"method": "generate (fp32)", "context": length, "context_tokens": context, **ref})
        print(rows[-1], flush=True)

        def measured(label: str, r: dict[str, Any], length=length, context=context, ref=ref, **ratios: float) -> None:
            rows.append(
                {
                    "method": label,
                    "context": length,
                    "context_tokens": context,
                    **r,
                    "decode_vs_generate": r["decode_tok_s"] / ref["decode_tok_s"],
                    "ttft_vs_generate": r["ttft_s"] / ref["ttft_s"],
                    **ratios,
                }
            )
            print(rows[-1], flush=True)

        for method in methods:
            if not recall:
                measured(method, _ours(engine, ids, cache(method), new_tokens))
                continue
            without, *with_recall = _paired(
                engine, ids, [cache(method), *(cache(method, n) for n in recall)], new_tokens
            )
            measured(method, without)
            for n, r in zip(recall, with_recall):
                measured(
                    f"{method}+recall{n}",
                    r,
                    decode_vs_method=r["decode_tok_s"] / without["decode_tok_s"],
                    ttft_vs_method=r["ttft_s"] / without["ttft_s"],
                    next_turn_vs_method=r["next_turn_ttft_s"] / without["next_turn_ttft_s"],
                )
        if "window" in methods and length in TTFT_CONTEXTS:
            # What bounded-memory prefill costs instead: each chunk attends to at most
            # sinks + window + chunk entries, not to the whole document.
            measured(
                "window (streaming prefill)", _ours(engine, ids, cache("window", prefill_mode="streaming"), new_tokens)
            )
        cpp = _llama_cpp(gguf, engine.tokenizer.decode(ids), context, torch.get_num_threads())
        if cpp is not None:
            rows.append({"method": "llama.cpp", "context": length, "context_tokens": context, **cpp})
            print(rows[-1], flush=True)
    window = {r["context"]: r["ttft_s"] for r in rows if r["method"] == "window"}
    for r in rows:
        if r["context"] in window and r["method"] not in ("generate (fp32)", "llama.cpp"):
            r["ttft_vs_window"] = r["ttft_s"] / window[r["context"]]
    return rows


def _kept_positions(session) -> list[list[set[int]]]:
    """Per layer and KV head, the positions of the middle entries."""
    kept = []
    for layer in session.cache.compressed_layers:
        m = layer.middle
        finite = torch.isfinite(m.log_num) | torch.isfinite(m.log_den)
        kept.append([set(m.positions[h][finite[h]].tolist()) for h in range(m.positions.shape[0])])
    return kept


@torch.inference_mode()
def part_mass(engine, methods: list[str], length: int, budget: str) -> list[dict[str, Any]]:
    """Per score-based method and stride: time to first token and the kept middle's
    overlap with the one every query gives (stride 1)."""
    from kvchat.compress import get
    from kvchat.settings import CacheSettings

    rows = []
    ids = _prompt_ids(engine, length)
    for method in methods:
        if not get(method).needs_attention:
            continue
        result = {}
        for stride in MASS_STRIDES:
            session = engine.new_session(CacheSettings(method=method, budget=budget))
            session.cache.mass_stride = stride
            start = time.perf_counter()
            session.feed(ids)
            result[stride] = (time.perf_counter() - start, _kept_positions(session))
        exact = result[1][1]
        for stride in MASS_STRIDES[1:]:
            sampled = result[stride][1]
            overlaps = [len(a & b) / max(1, len(a | b)) for la, lb in zip(exact, sampled) for a, b in zip(la, lb)]
            rows.append(
                {
                    "method": method,
                    "context": length,
                    "stride": stride,
                    "ttft_exact_mass_s": result[1][0],
                    "ttft_sampled_mass_s": result[stride][0],
                    "kept_jaccard_mean": statistics.mean(overlaps),
                    "kept_jaccard_min": min(overlaps),
                }
            )
            print(rows[-1], flush=True)
    return rows


_SPINNER = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass"


@torch.inference_mode()
def part_threads(engine, length: int = 256) -> list[dict[str, Any]]:
    """Decode with nothing else running (1 thread), then under one CPU-bound competitor
    with the governor choosing, and with 2 threads fixed."""
    from kvchat.runtime import ThreadGovernor
    from kvchat.settings import CacheSettings

    ids = _prompt_ids(engine, length)
    settings = CacheSettings()
    governor = engine.threads
    rows = []

    def measure(label: str, fixed: int | None, competitor: bool) -> None:
        engine.threads = ThreadGovernor(fixed)
        spinner = subprocess.Popen([sys.executable, "-c", _SPINNER.format(s=120)]) if competitor else None
        try:
            if spinner is not None:
                time.sleep(0.5)
            engine.threads.start()
            r = _ours(engine, ids, settings, new_tokens=64, next_turn=False)
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
        rows.append({"case": label, "threads_end": engine.threads.threads, "decode_tok_s": r["decode_tok_s"]})
        print(rows[-1], flush=True)

    try:
        measure("idle, 1 thread", 1, False)
        measure("one competitor, governor", None, True)
        measure("one competitor, 2 threads fixed", 2, True)
    finally:
        engine.threads = governor
        governor.adjust(force=True)
    idle = rows[0]["decode_tok_s"]
    for r in rows:
        r["vs_idle_1_thread"] = r["decode_tok_s"] / idle
    return rows


AGREEMENT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis briefly.",
    "List three uses of copper.",
    "Who wrote Hamlet?",
    "How do vaccines work?",
    "Give me a tip for sleeping well.",
    "What is 12 times 12?",
    "Describe a cat in two sentences.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "What is a prime number?",
    "Name the planets of the solar system.",
    "How does a bicycle stay upright?",
    "Suggest a name for a bakery.",
    "What causes rain?",
    "Summarize the plot of Cinderella.",
    "What is the boiling point of water?",
    "Tell me a fun fact about owls.",
    "How do I make a cup of tea?",
]


@torch.inference_mode()
def part_agreement(engine, exact_model, prompts: list[str]) -> list[dict[str, Any]]:
    """Greedy tokens of the engine's weight path against float32 weights, same loop."""
    from kvchat.model.engine import Engine
    from kvchat.settings import CacheSettings, SamplingSettings

    if exact_model is engine.model:
        return []
    from kvchat.model.loading import LoadedModel

    loaded = engine.loaded
    exact = Engine(
        LoadedModel(
            exact_model,
            loaded.tokenizer,
            loaded.source,
            "exact",
            loaded.device,
            torch.float32,
            None,
            label=loaded.label,
        ),
        threads=engine.threads.threads,
    )
    sampling = SamplingSettings(max_new_tokens=AGREEMENT_TOKENS)
    rows = []
    for prompt in prompts:
        fast = engine.new_session(CacheSettings()).send(prompt, sampling).token_ids
        ref = exact.new_session(CacheSettings()).send(prompt, sampling).token_ids
        prefix = next((i for i, (a, b) in enumerate(zip(fast, ref)) if a != b), min(len(fast), len(ref)))
        rows.append(
            {"prompt": prompt, "identical": fast == ref, "agreeing_prefix": prefix, "tokens": max(len(fast), len(ref))}
        )
    print({"identical": sum(r["identical"] for r in rows), "of": len(rows)}, flush=True)
    return rows


def run(options: BenchOptions) -> int:
    from kvchat.compress import available
    from kvchat.model.sources import resolve

    parts = list(options.parts or PARTS)
    unknown = set(parts) - set(PARTS + NAMED_PARTS)
    if unknown:
        raise ValueError(f"unknown --parts {', '.join(sorted(unknown))}; use {', '.join(PARTS + NAMED_PARTS)}")
    if options.skip_loop and "start" in parts:
        parts.remove("start")
    if "kernels" in parts:  # before this process loads a model: its sides run alone
        from kvchat.bench import kernels

        kernels.run(options.out, options.quick)
        parts.remove("kernels")
        if not parts:
            print(f"reports written to {options.out}/")
            return 0
    out, quick, model_path = options.out, options.quick, options.model.model
    methods = list(options.methods or available())
    contexts = list(options.contexts or ([256, 2048] if quick else CONTEXTS))
    # The cache options given (--budget, --window, --sinks, each method's hyperparameters);
    # an unset budget is 1024 middle entries.
    base = options.cache.for_method(budget="1024")
    budget = base.budget
    recall = [n for n in dict.fromkeys(parse_recall(n) for n in options.recall or ()) if n > 0]
    start_rows = part_start(model_path) if "start" in parts else []
    from kvchat.model.engine import load_engine

    engine = load_engine(options.model)
    exact_model = _exact_model(engine, model_path) if {"methods", "agreement"} & set(parts) else None
    found = resolve(model_path).path  # (llama.cpp's row reads a GGUF file of any name)
    gguf = str(found) if found.is_file() else None
    extra = {"precision": engine.loaded.precision, "threads": torch.get_num_threads()}

    if start_rows:
        report.write(
            out,
            "speed_start",
            start_rows,
            ["what", "best_s", "median_s", "runs"],
            title="Start-up: a whole process that loads the model and answers",
            extra=extra,
        )
    if "methods" in parts:
        rows = part_methods(
            engine,
            exact_model,
            methods,
            contexts,
            budget,
            gguf,
            recall,
            settings=base,
            method_params=options.cache.method_params,
        )
        recall_columns = ["decode_vs_method", "ttft_vs_method", "next_turn_vs_method"] if recall else []
        recall_notes = (
            " `method+recallN`: the same method with the recall tier (kvchat/recall/tier.py: every token that leaves the "
            "window kept on disk in 8-bit keys and 4-bit values, N cold tokens per KV head attended at each step, in the layers the model "
            "copies from far back with: kvchat/calibration/calibrate.py recall_layers). A method and its recall rows are "
            "prefilled once each, then decoded and given the later turn from forks of that prefill in 3 rounds in "
            "turn: decode tok/s and next_turn_ttft are the medians of the rounds. decode_vs_method, "
            "ttft_vs_method and next_turn_vs_method = its decode tok/s, "
            "ttft and next_turn_ttft over the same method's without recall at that context (targets: "
            "decode at least 0.8x, next turn at most 1.1x)."
            if recall
            else ""
        )
        report.write(
            out,
            "speed_methods",
            rows,
            [
                "method",
                "context",
                "context_tokens",
                "ttft_s",
                "ttft_vs_window",
                "ttft_vs_generate",
                "decode_tok_s",
                "decode_vs_generate",
                "kv_mb",
                "compress_share",
                "prefill_mode",
                "next_turn_ttft_s",
                *recall_columns,
            ],
            title=f"Time to first token and decode per method ({engine.loaded.precision}; budget {budget}, "
            f"window {base.window}, {base.sinks} sinks{_given_params(options.cache.method_params)}) "
            "against transformers generate in float32",
            notes="One document message of context_tokens essay tokens; ttft = prefill + compression + first "
            f"token; decode = {DECODE_TOKENS} forced greedy tokens after it "
            f"({DECODE_TOKENS // DEFAULT_BATCH} eviction batches: the steady state); compress_share = "
            "time inside compressors / decode time; next_turn_ttft = a later turn's time to first "
            f"token: the question {NEXT_TURN_QUESTION!r} fed as the next user message (the chat "
            "template's end of the answer, the message and the assistant's header, as the app feeds "
            "it) with the document and the decoded answer in the cache. Side by side in one run." + recall_notes,
            extra={**extra, "recall": recall},
        )
        series: dict[str, tuple[list[float], list[float]]] = {}
        memory: dict[str, tuple[list[float], list[float]]] = {}
        for r in rows:
            series.setdefault(r["method"], ([], []))
            series[r["method"]][0].append(r["context_tokens"])
            series[r["method"]][1].append(r["decode_tok_s"])
            if "kv_mb" in r:
                memory.setdefault(r["method"], ([], []))
                memory[r["method"]][0].append(r["context_tokens"])
                memory[r["method"]][1].append(r["kv_mb"])
        report.plot(
            out,
            "speed_decode",
            series,
            xlabel="context tokens",
            ylabel="decode tokens/s",
            title="Decode speed vs context",
            logx=True,
        )
        report.plot(
            out, "speed_kv_mb", memory, xlabel="context tokens", ylabel="KV MB", title="KV memory vs context", logx=True
        )
    if "mass" in parts:
        rows = part_mass(engine, methods, _fits(engine, 2048 if quick else 6144), budget)
        if rows:
            report.write(
                out,
                "speed_mass",
                rows,
                [
                    "method",
                    "context",
                    "stride",
                    "ttft_exact_mass_s",
                    "ttft_sampled_mass_s",
                    "kept_jaccard_mean",
                    "kept_jaccard_min",
                ],
                title="Score-based methods: prefill attention mass from every query vs every stride-th",
                notes="Kept set = middle positions per (layer, KV head) after the document; Jaccard overlap "
                "of the two kept sets, mean and worst over the 90 (layer, head) pairs.",
                extra=extra,
            )
    if "threads" in parts:
        rows = part_threads(engine)
        report.write(
            out,
            "speed_threads",
            rows,
            ["case", "threads_end", "decode_tok_s", "vs_idle_1_thread"],
            title="Decode (256-token context, 64 tokens) under one CPU-bound competing process",
            extra=extra,
        )
    if "agreement" in parts:
        rows = part_agreement(engine, exact_model, AGREEMENT_PROMPTS[:3] if quick else AGREEMENT_PROMPTS)
        if rows:
            report.write(
                out,
                "speed_agreement",
                rows,
                ["prompt", "identical", "agreeing_prefix", "tokens"],
                title=f"Greedy answers, {engine.loaded.precision} against float32 weights ({AGREEMENT_TOKENS} tokens each)",
                notes=f"{sum(r['identical'] for r in rows)} of {len(rows)} answers identical.",
                extra=extra,
            )
    print(f"reports written to {out}/")
    return 0
