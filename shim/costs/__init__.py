"""The cost table: its prices, how they are measured, and the rules that decide from them."""
