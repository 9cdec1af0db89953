"""The bundle on disk: ``format`` (its file names, format tag and version), ``manifest`` (what
manifest.json holds, built from a conversion), ``write`` (atomic writing), ``read`` (the one way
to open and verify a bundle), ``inspect`` (``deploykit inspect``)."""
