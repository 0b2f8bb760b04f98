"""Head training."""
