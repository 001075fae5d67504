"""The fast paths keep what they must: int8 weights close to the float ones, a weight
cache and a converted model copy that change nothing, and a thread count that leaves
busy cores alone."""

from __future__ import annotations

import subprocess
import sys
import time
import warnings

import pytest
import torch
from tiny_gguf import assert_same_tensors

from kvchat.model import loading as models
from kvchat.model.engine import Engine
from kvchat.model.int8 import GEMM_ROWS, INT4_GROUP, Int8Linear, int8_available
from kvchat.runtime import ThreadGovernor, int4_available
from kvchat.settings import CacheSettings, SamplingSettings

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
    from kvchat.model.int8 import load_quantized, save_quantized

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
    spinner = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 20\nwhile time.time() < end: pass"]
    )
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


# -- the int8 weight cache: what a start reads instead of quantising -------------------------
def _logits(loaded, text="Attention sinks keep the first tokens."):
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids
    loaded.model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        return loaded.model(ids).logits


@pytest.fixture
def tiny_copy(tiny_model_dir, tmp_path, monkeypatch):
    """A copy of the tiny model folder that a test may rewrite, and a fresh data home."""
    import shutil

    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    folder = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, folder)
    return folder


def _refuse_to_quantise(monkeypatch):
    from kvchat.model import int8

    def refuse(*args, **kwargs):
        raise AssertionError("quantised although the weight cache was there")

    monkeypatch.setattr(int8, "quantize_linears", refuse)
    monkeypatch.setattr(int8, "quantize_to_file", refuse)


@needs_int8
def test_a_second_load_reads_the_weight_cache_and_quantises_nothing(tiny_copy, monkeypatch):
    heard: list[str] = []
    first = models.load_model(str(tiny_copy), device="cpu", dtype="int8", on_status=heard.append)
    assert not first.from_cache and len(heard) == 1 and "once" in heard[0]
    cache, _ = models.int8_cache(tiny_copy, first.fingerprint)
    written = cache.stat().st_mtime_ns
    _refuse_to_quantise(monkeypatch)
    second = models.load_model(str(tiny_copy), device="cpu", dtype="int8", on_status=heard.append)
    assert second.from_cache and second.fingerprint == first.fingerprint
    assert cache.stat().st_mtime_ns == written and len(heard) == 1  # read, not written again
    assert torch.equal(_logits(second), _logits(first))


@needs_int8
def test_the_cached_weights_are_mapped_aligned_from_a_standard_safetensors_file(tiny_copy):
    from safetensors import safe_open

    from kvchat.model.int8 import ALIGN, quantized_tensors

    first = models.load_model(str(tiny_copy), device="cpu", dtype="int8")
    second = models.load_model(str(tiny_copy), device="cpu", dtype="int8")
    cache, expected_metadata = models.int8_cache(tiny_copy, second.fingerprint)
    # Every int8 weight is used where it lies (the int8 kernel needs it aligned).
    held = quantized_tensors(second.model)
    assert all(t.data_ptr() % ALIGN == 0 for name, t in held.items() if name.endswith("weight_int8"))
    # Any safetensors reader opens the file and finds the quantised model in it.
    with safe_open(str(cache), framework="pt") as f:
        assert f.metadata() == expected_metadata
        stored = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    original = quantized_tensors(first.model)
    assert stored.keys() == original.keys()
    assert all(torch.equal(stored[name], original[name]) for name in stored)


@needs_int8
def test_a_rewritten_model_folder_is_quantised_again(tiny_copy, monkeypatch):
    from transformers import LlamaForCausalLM

    first = models.load_model(str(tiny_copy), device="cpu", dtype="int8")
    # Other weights of the same shapes: the same file size and the same fingerprint.
    torch.manual_seed(1)
    LlamaForCausalLM(first.config.__class__.from_pretrained(tiny_copy)).save_pretrained(tiny_copy)
    second = models.load_model(str(tiny_copy), device="cpu", dtype="int8")
    assert not second.from_cache and second.fingerprint == first.fingerprint
    assert not torch.equal(_logits(second), _logits(first))
    _refuse_to_quantise(monkeypatch)
    assert models.load_model(str(tiny_copy), device="cpu", dtype="int8").from_cache


@needs_int8
@pytest.mark.parametrize("stale", ["no metadata", "another format", "another transformers", "damaged"])
def test_a_stale_or_damaged_weight_cache_is_replaced(tiny_copy, stale):
    from kvchat.model.int8 import read_metadata, save_quantized

    first = models.load_model(str(tiny_copy), device="cpu", dtype="int8")
    cache, metadata = models.int8_cache(tiny_copy, first.fingerprint)
    # The stale file replaces the cache as a new file: `first` runs on the cache's
    # tensors mapped in place, which rewriting that file under it would pull away.
    stale_file = cache.with_name("stale")
    if stale == "damaged":
        stale_file.write_bytes(cache.read_bytes()[:1000])
    else:
        changed = (
            {}
            if stale == "no metadata"
            else {**metadata, **({"format": "1"} if stale == "another format" else {"transformers": "4.0.0"})}
        )
        save_quantized(first.model, str(stale_file), changed)
    stale_file.replace(cache)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a damaged file is named in a warning
        again = models.load_model(str(tiny_copy), device="cpu", dtype="int8")
    assert not again.from_cache
    assert read_metadata(str(cache)) == metadata  # written again, current
    assert torch.equal(_logits(again), _logits(first))


@needs_int8
def test_an_int8_linear_over_stored_tensors_computes_like_the_one_that_quantised_them():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=True)
    made = Int8Linear(linear.weight, linear.bias)
    again = Int8Linear.from_quantized(made.weight_int8.clone(), made.scale.clone(), made.bias.clone())
    for rows in (1, GEMM_ROWS + 1):
        x = torch.randn(rows, 64)
        assert torch.equal(again(x), made(x))


needs_int4 = pytest.mark.skipif(not int4_available(), reason="this PyTorch build has no CPU int4 weight-pack matmul")


def q4_1_weight(rows: int = 96, columns: int = 128) -> torch.Tensor:
    """A weight as GGUF's Q4_1 stores one: each block of 32 is min + step * q, q in 0..15."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (rows, columns // INT4_GROUP, INT4_GROUP), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # the block's own min and max are on the grid's ends
    step = torch.rand(rows, columns // INT4_GROUP, 1, generator=gen) * 0.01 + 0.001
    low = torch.randn(rows, columns // INT4_GROUP, 1, generator=gen) * 0.05
    return (low + step * q).reshape(rows, columns)


@needs_int4
def test_a_weight_already_in_4_bits_decodes_through_int4_and_a_float_one_keeps_int8():
    assert Int8Linear(q4_1_weight(), None).weight_int4 is not None
    torch.manual_seed(0)
    assert Int8Linear(torch.randn(96, 128), None).weight_int4 is None  # 16 levels would lose more than int8


@needs_int4
def test_the_int4_decode_computes_the_4_bit_weight_and_a_prefill_the_int8_one():
    weight = q4_1_weight()
    layer = Int8Linear(weight, None)
    x = torch.randn(GEMM_ROWS + 1, 128, dtype=torch.bfloat16)
    exact = x.float() @ weight.t()
    decode = torch.cat([layer(row[None]) for row in x]).float()  # one row at a time: the int4 kernel
    prefill = layer(x).float()  # many rows: bf16 GEMM on the int8 weight
    assert (decode - exact).norm() / exact.norm() < 0.004  # bf16 rounding only: the grid is kept exactly
    assert (prefill - exact).norm() / exact.norm() < 0.01  # int8 rounding of the grid on top
    assert (decode - exact).norm() < (prefill - exact).norm()


@needs_int4
def test_the_embedded_models_q4_linears_decode_in_4_bits_and_the_cache_keeps_them(embedded_fast, tmp_path):
    from kvchat.model.int8 import load_quantized, save_quantized

    linears = [m for m in embedded_fast.model.modules() if isinstance(m, Int8Linear)]
    four = [m for m in linears if m.weight_int4 is not None]
    # Every linear of the 30 blocks is Q4_1 in the GGUF; the lm_head (tied to the Q8_0
    # embedding) is not, and keeps int8 alone.
    assert len(four) == 30 * 7 == len(linears) - 1
    path = tmp_path / "weights.int8.safetensors"
    save_quantized(embedded_fast.model, str(path))
    reloaded = load_quantized(embedded_fast.config, str(path), embedded_fast.dtype)
    again = [m for m in reloaded.modules() if isinstance(m, Int8Linear) and m.weight_int4 is not None]
    assert len(again) == len(four) and torch.equal(again[0].weight_int4, four[0].weight_int4)


def _tiny_float_llama():
    """A 2-layer Llama in float32 with a tied output layer, whose MLP weights lie on Q4_1's
    grid (so they keep an int4 copy) and whose attention weights do not."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for linear in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                linear.weight.copy_(q4_1_weight(*linear.weight.shape))
    return model.eval()


@needs_int8
def test_quantising_into_the_file_writes_the_cache_quantising_the_model_would(tmp_path):
    import copy

    from kvchat.model.int8 import quantize_linears, quantize_to_file, save_quantized

    model = _tiny_float_llama()
    metadata = {"format": "test", "source": "tiny"}
    quantize_to_file(model, str(tmp_path / "streamed.safetensors"), metadata)
    assert all(type(m) is not Int8Linear for m in model.modules())  # the float model is left as it was
    whole = copy.deepcopy(model)
    quantize_linears(whole)
    save_quantized(whole, str(tmp_path / "whole.safetensors"), metadata)
    if int4_available():
        assert any(m.weight_int4 is not None for m in whole.modules() if isinstance(m, Int8Linear))
        assert any(m.weight_int4 is None for m in whole.modules() if isinstance(m, Int8Linear))
    assert_same_tensors(tmp_path / "streamed.safetensors", tmp_path / "whole.safetensors")


@needs_int8
def test_a_cache_quantised_into_the_file_maps_its_int8_weights_aligned(tmp_path):
    from kvchat.model.int8 import ALIGN, load_quantized, quantize_to_file, quantized_tensors

    model = _tiny_float_llama()
    quantize_to_file(model, str(tmp_path / "streamed.safetensors"))
    loaded = load_quantized(model.config, str(tmp_path / "streamed.safetensors"))
    held = quantized_tensors(loaded)
    assert all(t.data_ptr() % ALIGN == 0 for name, t in held.items() if name.endswith("weight_int8"))


@needs_int8
@pytest.mark.slow  # loads and quantises the embedded model twice (about 20 s)
def test_the_embedded_models_cache_quantised_into_the_file_is_the_one_quantising_the_model_writes(tmp_path):
    from transformers import AutoModelForCausalLM

    from kvchat.model.int8 import quantize_linears, quantize_to_file, save_quantized

    copy = models.converted_copy(models.embedded_model_path())
    assert copy is not None
    folder = copy[0]
    metadata = {"source": "embedded"}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)  # memory-mapped
    quantize_to_file(model, str(tmp_path / "streamed.safetensors"), metadata)
    quantize_linears(model)
    save_quantized(model, str(tmp_path / "whole.safetensors"), metadata)
    assert_same_tensors(tmp_path / "streamed.safetensors", tmp_path / "whole.safetensors")


def test_gc_is_paused_inside_the_block_and_restored_after():
    import gc

    assert gc.isenabled()
    with models.gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with models.gc_paused():
            pass
        assert not gc.isenabled()  # a caller's own choice is kept
    finally:
        gc.enable()


@needs_int8
def test_load_engine_picks_threads_from_the_load_and_leaves_the_collector_on(tiny_copy, monkeypatch):
    import gc

    from kvchat.model.engine import load_engine
    from kvchat.settings import ModelOptions

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    previous = torch.get_num_threads()

    def no_wait(seconds):
        raise AssertionError("the governor waited for a sample; the load is its sample")

    monkeypatch.setattr(time, "sleep", no_wait)
    try:
        engine = load_engine(ModelOptions(model=str(tiny_copy), device="cpu", dtype="int8"), on_status=lambda m: None)
    finally:
        gc.unfreeze()  # load_engine froze what this test process holds
        torch.set_num_threads(previous)
    assert gc.isenabled()
    assert 1 <= engine.threads.threads <= engine.threads.cores
    engine.new_session(CacheSettings()).send("Hi", SamplingSettings(max_new_tokens=2))
    assert engine.forward_calls >= 1
