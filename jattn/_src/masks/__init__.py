"""Masks and programmable attention: structural masks, mask/score mods, block classes."""
