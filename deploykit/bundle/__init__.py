"""The bundle on disk: ``format`` (what a manifest holds), ``write`` (atomic writing), ``read``
(opening and verifying), ``inspect`` (``deploykit inspect``)."""
