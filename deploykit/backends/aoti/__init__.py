"""AOTInductor packages: the model compiled ahead of time by torch (``--backend aoti``), run by torch."""
