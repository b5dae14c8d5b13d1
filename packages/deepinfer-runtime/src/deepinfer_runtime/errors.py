"""User-facing errors: each names the file, field or tensor at fault."""


class DeepInferError(Exception):
    """Base of the errors DeepInfer raises on bad input."""


class ConfigError(DeepInferError, ValueError):
    """A config.json field is unknown, missing, of the wrong type or inconsistent."""


class CheckpointError(DeepInferError, ValueError):
    """A checkpoint directory is missing, incomplete, corrupt, or holds unexpected tensors."""
