"""The model side: loading a model (embedded GGUF, HF folder, GGUF file, bitsandbytes),
int8 weights for the CPU, the engine that owns the model, and one chat's generation loop."""
