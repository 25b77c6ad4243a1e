"""k3export: compile the Kimi K3 hybrid LLM (KDA + Gated MLA + Stable LatentMoE + Block AttnRes) for deployment."""

from k3export.config import ConfigError, K3Config
from k3export.model import K3Model, K3State

__version__ = "0.1.0"
__all__ = ["ConfigError", "K3Config", "K3Model", "K3State", "__version__"]
