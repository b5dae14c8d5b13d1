"""deepinfer-runtime: the DeepInfer engine (models, checkpoint loading, caches, scheduler, API)."""

from deepinfer_runtime.errors import CheckpointError, ConfigError, DeepInferError
from deepinfer_runtime.llm import LLM
from deepinfer_runtime.model_loader import load_model
from deepinfer_runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer_runtime.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "load_model",
    "ConfigError",
    "CheckpointError",
    "DeepInferError",
]
