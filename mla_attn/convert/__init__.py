"""Real checkpoints: read DeepSeek-style safetensors (FP8 included), absorb MLA weights, convert.

See ``README.md`` in this folder for the absorption algebra and ``docs/checkpoints.md`` for the
user guide.
"""

from .absorb import absorb_mla_weights, absorption_cost, attention_dims
from .checkpoint import CheckpointError, convert_checkpoint, load_checkpoint
from .fp8 import dequantize_fp8_block, quantize_fp8_block

__all__ = [
    "CheckpointError",
    "absorb_mla_weights",
    "absorption_cost",
    "attention_dims",
    "convert_checkpoint",
    "dequantize_fp8_block",
    "load_checkpoint",
    "quantize_fp8_block",
]
