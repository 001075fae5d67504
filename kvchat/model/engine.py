"""The generation engine: the loaded model and tokenizer, shared by every conversation
(`kvchat.model.session.ChatSession`), its per-model measurements, and one forward pass
of new tokens through a conversation's `CompressedCache`."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import Any

from kvchat.model.loading import LoadedModel, cache_keyword, gc_paused  # first: see its imports

# isort: split
import torch
from torch import Tensor

from kvchat.cache import attention
from kvchat.cache.compressed_cache import CompressedCache
from kvchat.errors import SettingsError
from kvchat.model.session import ChatSession
from kvchat.runtime import ThreadGovernor, release_free_heap
from kvchat.settings import DEFAULT_RECALL, Budget, CacheSettings, ModelOptions


class Engine:
    """A loaded model ready for kvchat sessions."""

    def __init__(
        self, loaded: LoadedModel, threads: int | None = None, *, governor: ThreadGovernor | None = None
    ) -> None:
        attention.register()
        # Intra-op threads: the free cores (kvchat/runtime.py), re-checked as we go. One that
        # watched the machine while the model loaded (`load_engine`) decides at once.
        self.threads = governor or ThreadGovernor(threads)
        self.threads.adjust(force=True) if governor else self.threads.start()
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model.set_attn_implementation(attention.ATTN_NAME)
        self.forward_calls = 0  # counted for tests (resume must not re-prefill)
        self.tokens_fed = 0
        self.stop_ids = self._stop_ids()
        self.cache_keyword = cache_keyword(self.model)
        self._calibrations: dict[str, dict[int, dict[str, Any]]] = {}  # method -> layer -> params
        self._measured: dict[str, list] = {}  # kvchat.calibration.calibrate's per-model measurements

    def _stop_ids(self) -> set[int]:
        ids = set()
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        for value in (eos, self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(v for v in value if isinstance(v, int))
        for token in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
            tid = self.tokenizer.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id and tid is not None:
                ids.add(tid)
        return ids

    def new_cache(self, settings: CacheSettings) -> CompressedCache:
        budget = Budget.parse(settings.budget)
        return CompressedCache.for_model(
            self.loaded,
            method=settings.method,
            budget=budget,
            window=settings.window,
            sinks=settings.sinks,
            batch=settings.batch,
            params=settings.params,
            seed=settings.seed,
            layer_params=self.calibrated_params,
            layer_weights=self.measured("layer_weights") if budget.in_bytes and settings.allocation == "auto" else None,
            recall=settings.recall,
            recall_layers=self.measured("recall_layers") if settings.recall else None,
            fit_window=settings.fit_window,
        )

    def measured(self, what: str) -> list:
        """A per-model measurement of `kvchat.calibration.calibrate`: "layer_weights" (how much middle
        each layer needs) or "recall_layers" (the layers that recall): measured once per
        model, cached on disk, shared by this engine's sessions."""
        if what not in self._measured:
            from kvchat.calibration import calibrate

            self._measured[what] = getattr(calibrate, what)(self.loaded)
        return self._measured[what]

    def calibrated_params(self, method: str, layer: int) -> dict[str, Any]:
        """Per-layer parameters a method takes from a one-off model calibration: those of
        its compressor's `calibrate` hook (if it has one), computed once per model."""
        from kvchat import compress

        hook = getattr(compress.get(method), "calibrate", None)
        if hook is None:
            return {}
        if method not in self._calibrations:
            from kvchat.calibration.calibrate import calibrated_layer_params

            self._calibrations[method] = calibrated_layer_params(self.loaded, compress.get(method))
        return dict(self._calibrations[method].get(layer, {}))

    def new_session(self, settings: CacheSettings | None = None, *, system: str | None = None) -> ChatSession:
        return ChatSession(self, settings or CacheSettings(), system=system)

    @property
    def default_recall(self) -> int:
        """Recall when the user did not choose: on where its speed was measured (kvchat/settings.py)."""
        from kvchat import native

        return DEFAULT_RECALL if self.loaded.device.type == "cpu" and native.ranking_path() is not None else 0

    @torch.inference_mode()
    def forward(self, ids: list[int] | Tensor, cache: CompressedCache) -> Tensor:
        """One forward pass of new tokens through the cache; returns last-position logits."""
        input_ids = ids if isinstance(ids, Tensor) else torch.tensor([ids], dtype=torch.long)
        input_ids = input_ids.to(self.loaded.device)
        positions = cache.positions_for(input_ids.shape[1]).to(self.loaded.device)
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            **{self.cache_keyword: cache},
            use_cache=True,
            logits_to_keep=1,
            kvchat_cache=cache,
        )
        cache.settle()
        self.forward_calls += 1
        self.tokens_fed += input_ids.shape[1]
        return out.logits[0, -1].float()

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)


def load_engine(options: ModelOptions, on_status: Callable[[str], None] | None = None) -> Engine:
    """Load the model `options` name and wrap it in an engine. `on_status` hears about
    one-off steps (the first start converts the embedded GGUF; default: a line on stderr)."""
    from kvchat.model.loading import load_model

    if options.threads is not None and options.threads < 1:
        raise SettingsError("--threads must be at least 1")
    if on_status is None:
        on_status = _status_line
    governor = ThreadGovernor(options.threads)
    governor.adjust()  # its first sample of the machine spans the load: no wait for one after
    with gc_paused():
        loaded = load_model(
            options.model, device=options.device, dtype=options.dtype, quant=options.quant, on_status=on_status
        )
    engine = Engine(loaded, governor=governor)
    gc.freeze()  # what exists now lives as long as the process: see models.gc_paused
    release_free_heap()  # the load's conversions are done with
    return engine


def _status_line(message: str) -> None:
    print(f"kvchat: {message}", file=sys.stderr, flush=True)
