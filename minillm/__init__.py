"""minillm: a compact LLM serving engine for teaching how serving batches and schedules requests."""

# Before anything imports Triton (transformers may, through its model modules): on a
# machine without CUDA, choose Triton's interpreter, so attention_backend="triton" runs
# the real kernels on the CPU. Triton fixes this choice when it is first imported; see
# kernels/_triton_setup.py.
from minillm_kernels import ops as _kernels

try:
    _kernels.use_interpreter_if_no_cuda()
except RuntimeError:
    pass  # Triton came first: the torch backend works; attention_backend="triton" explains why not

from .config import EngineConfig
from .engine import LLMEngine
from .llm import LLM
from .outputs import RequestOutput
from .core.request import Request, RequestMetrics, RequestStatus
from .sampling_params import SamplingParams
from .step_record import StepRecord

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "Request",
           "RequestMetrics", "RequestStatus", "StepRecord"]
__version__ = "0.1.0"
