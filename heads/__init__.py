"""Learned heads (plain ``nn.Module``s) and their registry. Imports nothing of the project but its errors."""

from specheads.heads.acceptance_head import AcceptanceHead
from specheads.heads.eagle_head import EagleConfig, EagleHead
from specheads.heads.judge_head import JudgeHead
from specheads.heads.registry import HEADS
from specheads.heads.verifier_head import VerifierHead

__all__ = ["AcceptanceHead", "EagleConfig", "EagleHead", "HEADS", "JudgeHead", "VerifierHead"]
