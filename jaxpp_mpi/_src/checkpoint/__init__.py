"""Checkpoints: file format, atomic commit, save/restore, placement plans."""
