"""Whether a converted graph computes what the PyTorch model computes.

``compare`` (metrics and tolerances, pure numpy), ``validate`` (the reference and each candidate on the
same inputs), ``inputs`` (seeded random inputs, user .npz), ``layerwise`` (node-by-node comparison),
``auto_fix`` (pinning diverging nodes to fp32), ``groups`` (the node groups it tries when none diverges),
``cost`` (multiply-adds per node), ``bundle`` (``deploykit validate``: a bundle again, here).
"""
