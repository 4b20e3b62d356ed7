"""Ways of proposing tokens, one per file, registered in one table and chosen once."""

from verispec.drafters.base import Draft, Drafter, Verdict
from verispec.drafters.cross_tokenizer import CrossTokenizerDrafter
from verispec.drafters.eagle3 import Eagle3Drafter
from verispec.drafters.hybrid import HybridDrafter
from verispec.drafters.medusa import MedusaDrafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.mtp import MTPDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.none import NoDrafter
from verispec.drafters.shared import SharedCacheDrafter
from verispec.drafters.staged import StagedDrafter
from verispec.drafters.suffix import SuffixDrafter, SuffixIndex

__all__ = ["Draft", "Drafter", "Verdict", "CrossTokenizerDrafter", "Eagle3Drafter", "HybridDrafter", "MedusaDrafter", "ModelDrafter",
           "MTPDrafter", "NgramDrafter", "NoDrafter", "SharedCacheDrafter", "StagedDrafter", "SuffixDrafter", "SuffixIndex"]
