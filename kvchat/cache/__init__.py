"""The compressed KV cache: per layer, exact sinks + a compressor's middle + an exact window,
the attention function over them, positions and re-rotation, and how a budget is split."""
