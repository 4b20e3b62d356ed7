"""verispec: lossless speculative decoding. `load` a model, `generate` faster, get the same output."""

from verispec.api import GenerationResult, generate, load, stream
from verispec.errors import VerispecError
from verispec.heads import load_head
from verispec.sampling import SamplingParams
from verispec.stats import SpecStats

__all__ = ["generate", "load", "load_head", "stream", "GenerationResult", "SamplingParams", "SpecStats", "VerispecError"]
__version__ = "0.1.0"
