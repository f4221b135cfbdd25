"""Decoding over a paged, ragged KV cache."""
