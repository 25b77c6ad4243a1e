"""k3 custom ops (`torch.ops.k3.*`): one directory per op with naive.py (reference), op.py (registration +
fake), CONTRACT.md, and, once written, kernels.py (Triton) and trt.py (TensorRT adapter).

Importing this package registers every op; device kernels register themselves on import when available."""

from .attn_res.op import attn_res
from .kda.op import kda_decode, kda_prefill
from .mla.op import mla_decode, mla_prefill
from .moe.op import moe_routed

__all__ = ["attn_res", "kda_decode", "kda_prefill", "mla_decode", "mla_prefill", "moe_routed"]
