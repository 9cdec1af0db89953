"""Commands around a bundle that are not conversion: ``bench``, ``profile``, ``debug``, ``doctor``."""
