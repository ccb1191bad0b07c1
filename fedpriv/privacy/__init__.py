"""Mechanisms (clipping, noise) and accounting (privacy plans over dp-accounting)."""
