"""minillm: a compact LLM serving engine for teaching how serving batches and schedules requests."""

from .config import EngineConfig
from .engine import LLMEngine
from .llm import LLM
from .outputs import RequestOutput
from .request import Request, RequestMetrics, RequestStatus
from .sampling_params import SamplingParams
from .step_record import StepRecord

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "Request",
           "RequestMetrics", "RequestStatus", "StepRecord"]
__version__ = "0.1.0"
