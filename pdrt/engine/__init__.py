"""The per-worker inference engine: paged KV cache, scheduler, sampler, model runner.

`LLMEngine` is imported on first use: the light modules (config, sampling
parameters, outputs) are needed by processes that never load a model — the
controller, the supervisor, clients — and must not pay for torch and
transformers.
"""

from typing import Any

from pdrt.engine.config import EngineConfig
from pdrt.engine.outputs import ImportReservation, RequestOutput
from pdrt.engine.sampling_params import SamplingParams
from pdrt.engine.sequence import FinishReason

__all__ = ["EngineConfig", "FinishReason", "ImportReservation", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLMEngine":
        from pdrt.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
