"""Built-in YAML recipes (package data)."""
