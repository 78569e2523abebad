"""Coordinated prep: the staging area an HP group shares, and a member's pass over it."""
