"""The conversion report: ``report.json`` (machine-readable) and ``report.html`` (verdict first)."""

from __future__ import annotations

from deploykit.report.html import png_base64, render
from deploykit.report.plots import error_histogram_png
from deploykit.validation.validate import CandidateValidation


def render_html(report: dict, validations: list[CandidateValidation]) -> str:
    """HTML page of ``report`` with one error histogram per validated candidate."""
    plots = {
        v.label: png_base64(error_histogram_png(v.runs[-1].outputs, f"{v.label}, batch {v.runs[-1].batch}"))
        for v in validations
    }
    return render("report.html.j2", report=report, plots=plots)
