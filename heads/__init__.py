"""Learned heads (plain ``nn.Module``s) and their registry. Imports nothing of the project."""

from .acceptance import AcceptanceHead
from .eagle import EagleHead
from .judge import JudgeHead
from .registry import HEADS
from .verifier import VerifierHead

__all__ = ["AcceptanceHead", "EagleHead", "HEADS", "JudgeHead", "VerifierHead"]
