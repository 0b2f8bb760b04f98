"""Decoding across two tokenizers (TLI, SLEM, SLRS): the bridge, its loop and the token texts."""
