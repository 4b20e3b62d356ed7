"""Trained draft heads: small networks that read the target's hidden states and propose its next tokens.

`eagle3` holds the EAGLE-3 head and its files, `formats` the other ecosystems' layouts of it (speculators,
SpecForge), `medusa` Medusa-1 heads and theirs, `mtp` a DeepSeek-V3-style multi-token prediction module,
`files` the directory every kind writes; `data` extracts training features from a target, `train` trains
an EAGLE-3 head with training-time test, `train_medusa` Medusa heads, `train_mtp` an MTP module (with
`train`'s loop), `online` Medusa heads that keep learning from served traffic. The drafters that serve them
are `drafters.eagle3`, `drafters.medusa` and `drafters.mtp`.

`load_head` reads any kind from its directory: each kind declares the directories it recognizes
(`is_head_directory`) and how to load them, in the `KINDS` table.
"""

from pathlib import Path

from verispec.errors import VerispecError
from verispec.heads import eagle3, formats, medusa, mtp
from verispec.heads.eagle3 import Eagle3Config, Eagle3Head, save_head
from verispec.heads.medusa import MedusaConfig, MedusaHead
from verispec.heads.mtp import MTPConfig, MTPHead
from verispec.heads.online import OnlineConfig, OnlineMedusa

# (recognizes a directory, loads it): one row per kind of head
KINDS = ((eagle3.is_head_directory, formats.load_head), (medusa.is_head_directory, medusa.load_head),
         (mtp.is_head_directory, mtp.load_head))
HEAD_TYPES = (Eagle3Head, MedusaHead, MTPHead, OnlineMedusa)  # OnlineMedusa: Medusa heads learning from served traffic


def is_head_directory(path) -> bool:
    """Whether `path` is a directory holding a trained draft head of any kind."""
    return any(recognizes(path) for recognizes, _ in KINDS)


def load_head(directory, target=None):
    """The draft head saved in `directory` (EAGLE-3, Medusa or MTP; verispec's layout, or EAGLE-3's and Medusa's
    authors'), in eval mode; checked against (and, for EAGLE-3 and MTP, bound to) `target` when one is given."""
    for recognizes, load in KINDS:
        if recognizes(directory):
            return load(directory, target)
    raise VerispecError(f"{Path(directory)} is not a draft head: it needs a config.json naming an EAGLE-3, Medusa or "
                        "MTP head beside its weights (train one with `verispec train eagle3`, `verispec train medusa` "
                        "or `verispec train mtp`)")


__all__ = ["Eagle3Config", "Eagle3Head", "MedusaConfig", "MedusaHead", "MTPConfig", "MTPHead", "OnlineConfig", "OnlineMedusa",
           "HEAD_TYPES", "is_head_directory", "load_head", "save_head"]
