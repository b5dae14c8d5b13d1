"""deepinfer-kernels: every op DeepSeek V4 / V4.1 inference needs, each with a plain-PyTorch
reference that defines correct, plus GPU backends chosen through ``registry``.

The op index (one import per public op):
"""

from deepinfer_kernels.ops.rms_norm import rms_norm
from deepinfer_kernels.ops.rope import YarnScaling, rope_interleaved, rope_inv_freq

__version__ = "0.1.0"

__all__ = ["rms_norm", "rope_interleaved", "rope_inv_freq", "YarnScaling"]
