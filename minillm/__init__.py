"""minillm: a compact LLM serving engine for teaching how serving batches and schedules requests."""

# Importing the package imports neither torch nor transformers: the model loader imports them when it
# loads a model (a simulation needs the model's shape only), and chooses Triton's interpreter on a
# machine without CUDA before it first imports transformers (minillm/model/loader.py: choose_triton_mode).
# On a machine with no GPU driver the interpreter is chosen here already, so a program that imports
# transformers (which may import Triton) after minillm still gets it.
from .config import EngineConfig
from .engine import LLMEngine
from .llm import LLM
from .outputs import RequestOutput
from .core.request import Request, RequestMetrics, RequestStatus
from .sampling_params import SamplingParams
from .step_record import StepRecord
from minillm_kernels._triton_setup import use_interpreter_early

use_interpreter_early()

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "RequestOutput",
    "Request",
    "RequestMetrics",
    "RequestStatus",
    "StepRecord",
]
__version__ = "0.1.0"
