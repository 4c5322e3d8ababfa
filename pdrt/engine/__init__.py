"""The per-worker inference engine: paged KV cache, scheduler, sampler, model runner."""

from pdrt.engine.config import EngineConfig
from pdrt.engine.llm_engine import LLMEngine
from pdrt.engine.outputs import ImportReservation, RequestOutput
from pdrt.engine.sampling_params import SamplingParams
from pdrt.engine.sequence import FinishReason

__all__ = ["EngineConfig", "FinishReason", "ImportReservation", "LLMEngine", "RequestOutput", "SamplingParams"]
