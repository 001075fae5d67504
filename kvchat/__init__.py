"""kvchat: terminal chat with a local LLM whose KV cache stays small."""

__version__ = "0.1.0"
