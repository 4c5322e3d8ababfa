"""Prefill while the user types: drafts, their incremental tokenization, and their prefill on the workers."""
