"""Host optimizer: hybrid 8-bit AdamW with fused clipping, blockwise quantization, LR schedules."""
from .clipping import clip_coefficient, combine_norms, global_grad_norm, tensor_norms
from .hybrid_adamw import HybridAdamW
from .quantization import dequantize_blockwise, quantize_blockwise

__all__ = ["HybridAdamW", "global_grad_norm", "tensor_norms", "combine_norms", "clip_coefficient",
           "quantize_blockwise", "dequantize_blockwise"]
