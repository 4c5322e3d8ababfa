"""Tiny real models for tests and benchmarks, built locally in seconds."""
