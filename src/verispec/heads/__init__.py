"""Trained draft heads: small networks that read the target's hidden states and propose its next tokens.

`eagle3` holds the EAGLE-3 head and its files, `data` extracts training features from a target,
`train` trains a head with training-time test. The drafter that serves a head is `drafters.eagle3`.
"""

from verispec.heads.eagle3 import Eagle3Config, Eagle3Head, load_head, save_head

__all__ = ["Eagle3Config", "Eagle3Head", "load_head", "save_head"]
