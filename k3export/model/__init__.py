from k3export.model.k3 import K3Model
from k3export.model.state import K3State

__all__ = ["K3Model", "K3State"]
