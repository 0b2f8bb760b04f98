"""Head types by name, as written in exported metadata (``head_type``)."""

from __future__ import annotations

from torch import nn

from specheads.heads.acceptance_head import AcceptanceHead
from specheads.heads.eagle_head import EagleHead
from specheads.heads.judge_head import JudgeHead
from specheads.heads.verifier_head import VerifierHead

HEADS: dict[str, type[nn.Module]] = {
    "acceptance": AcceptanceHead,
    "verifier": VerifierHead,
    "judge": JudgeHead,
    "eagle": EagleHead,
}
