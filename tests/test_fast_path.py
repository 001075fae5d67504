"""The fast paths keep what they must: int8 weights close to the float ones, a weight
cache and a converted model copy that change nothing, and a thread count that leaves
busy cores alone."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from kvchat import models
from kvchat.engine import Engine
from kvchat.int8 import GEMM_ROWS, Int8Linear, int8_available
from kvchat.settings import CacheSettings, SamplingSettings
from kvchat.threads import ThreadGovernor

needs_int8 = pytest.mark.skipif(not int8_available(), reason="this PyTorch build has no int8 weight-pack matmul")


@needs_int8
@pytest.mark.parametrize("rows", [1, GEMM_ROWS, GEMM_ROWS + 1, 200])
def test_int8_linear_stays_within_a_percent_of_the_float_linear(rows):
    # Both kernels (int8 matmul for a few rows, bf16 GEMM on the dequantised weight for
    # many) give the float result up to int8 rounding of the weight and bf16 compute.
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 1536, bias=True)
    x = torch.randn(2, rows, 576)
    reference = linear(x)
    out = Int8Linear(linear.weight, linear.bias)(x)
    assert out.shape == reference.shape
    relative = (out.float() - reference).norm() / reference.norm()
    assert relative < 0.01


@needs_int8
def test_int8_weight_cache_loads_the_same_model(embedded_fast, tmp_path):
    from kvchat.int8 import load_quantized, save_quantized

    path = tmp_path / "weights.int8.safetensors"
    save_quantized(embedded_fast.model, str(path))
    reloaded = load_quantized(embedded_fast.config, str(path), embedded_fast.dtype)
    ids = embedded_fast.tokenizer("The capital of France is", return_tensors="pt").input_ids
    previous = embedded_fast.model.config._attn_implementation
    with torch.inference_mode():
        embedded_fast.model.set_attn_implementation("sdpa")
        reloaded.set_attn_implementation("sdpa")
        # Both models share one config object: run both before the attention is restored
        # (an Engine made earlier in the session set it to kvchat's).
        try:
            expected = embedded_fast.model(ids).logits
            got = reloaded(ids).logits
        finally:
            embedded_fast.model.set_attn_implementation(previous)
        assert torch.equal(got, expected)


@needs_int8
def test_the_fast_path_answers_like_the_exact_one(embedded_fast):
    engine = Engine(embedded_fast)
    session = engine.new_session(CacheSettings())
    assert "Paris" in session.send("What is the capital of France?", SamplingSettings(max_new_tokens=24)).text
    assert embedded_fast.precision == "int8+bf16"
    assert session.cache.nbytes() > 0 and session.cache.specs[0].dtype == torch.bfloat16  # bf16 KV: half the bytes


def test_float32_is_the_exact_path_and_differs_in_fingerprint(embedded, embedded_fast):
    assert embedded.precision == "float32" and embedded.weights == "float"
    # A snapshot made under one weight path is refused by the other (its K/V differ).
    assert embedded.fingerprint != embedded_fast.fingerprint


def test_the_converted_copy_gives_the_gguf_models_logits(embedded, tmp_path, monkeypatch):
    # The copy is made once, announced once, and holds exactly the weights transformers'
    # GGUF loader produces (which it would otherwise redo on every start).
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path))
    heard: list[str] = []
    first = models.load_model(device="cpu", dtype="float32", on_status=heard.append)
    second = models.load_model(device="cpu", dtype="float32", on_status=heard.append)
    assert len(heard) == 1 and "once" in heard[0]
    assert first.fingerprint == second.fingerprint == embedded.fingerprint
    gguf = models.embedded_model_path()
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    ids = second.tokenizer("Attention sinks keep the first tokens.", return_tensors="pt").input_ids
    second.model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        assert torch.equal(second.model(ids).logits, direct(ids).logits)
    assert second.tokenizer("naïve café").input_ids == first.tokenizer("naïve café").input_ids


def test_threads_follow_the_free_cores():
    governor = ThreadGovernor()
    governor.cores = 2
    assert governor.choose(others_busy=0.0) == 2
    assert governor.choose(others_busy=0.3) == 2
    assert governor.choose(others_busy=1.0) == 1
    assert governor.choose(others_busy=2.0) == 1  # never fewer than one


def test_an_explicit_thread_count_wins(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    governor = ThreadGovernor(fixed=1)
    assert governor.start() == 1 and torch.get_num_threads() == 1
    with pytest.raises(ValueError, match="at least 1"):
        ThreadGovernor(fixed=0)


def test_a_busy_competitor_takes_a_core_away(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    governor = ThreadGovernor()
    if governor.cores < 2:
        pytest.skip("needs at least two cores")
    previous = torch.get_num_threads()
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 20\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.5)
        governor.start()
        time.sleep(0.5)
        assert governor.adjust() <= governor.cores - 1
        assert governor.others_busy >= 0.5
    finally:
        spinner.kill()
        spinner.wait()
        torch.set_num_threads(previous)
