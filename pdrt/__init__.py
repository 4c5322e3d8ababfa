"""pdrt: a prefill/decode-disaggregated LLM serving runtime."""

__version__ = "0.1.0"
