"""Synthetic wiki-18-shaped corpora for scale tests (see `generate`)."""
