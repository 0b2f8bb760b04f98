"""The decoding loop and its round: the engine, the tree loop, what a round leaves, drafting (a draft model's or an
EAGLE head's)."""
