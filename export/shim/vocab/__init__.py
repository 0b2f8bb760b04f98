"""Vocabularies: draft pruning (FR-Spec) and decoding across two tokenizers (TLI, SLEM, SLRS)."""
