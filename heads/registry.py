"""Head types by name, as written in exported metadata (``head_type``)."""

from __future__ import annotations

from torch import nn

from .acceptance import AcceptanceHead
from .eagle import EagleHead
from .judge import JudgeHead
from .verifier import VerifierHead

HEADS: dict[str, type[nn.Module]] = {"acceptance": AcceptanceHead, "verifier": VerifierHead, "judge": JudgeHead,
                                     "eagle": EagleHead}
