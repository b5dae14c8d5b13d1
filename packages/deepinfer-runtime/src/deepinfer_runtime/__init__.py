"""deepinfer-runtime: the DeepInfer engine (models, checkpoint loading, caches, scheduler, API)."""

from deepinfer_runtime.errors import CheckpointError, ConfigError, DeepInferError
from deepinfer_runtime.model_loader import load_model

__version__ = "0.1.0"

__all__ = ["load_model", "ConfigError", "CheckpointError", "DeepInferError"]
