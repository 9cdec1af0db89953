"""What users import: ``convert()`` runs the conversion pipeline, ``load()`` opens a bundle to run it."""

from deploykit.conversion.options import ConvertOptions
from deploykit.conversion.pipeline import ConvertResult, convert
from deploykit.runtime import load

__all__ = ["ConvertOptions", "ConvertResult", "convert", "load"]
