"""``deploykit export``: a bundle rewritten for another serving system (``triton``: a Triton model repository)."""
