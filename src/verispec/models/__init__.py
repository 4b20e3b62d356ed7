"""Models as the engine sees them: forward new tokens against a cache that can be rolled back."""

from verispec.models.base import CausalLM, ModelCache
from verispec.models.hf import HFCausalLM

__all__ = ["CausalLM", "ModelCache", "HFCausalLM"]
