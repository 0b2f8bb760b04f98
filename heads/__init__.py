"""Learned heads (plain nn.Modules) and their registry."""
