"""The conversion report: ``report.json`` (machine-readable) and ``report.html`` (verdict first)."""

from __future__ import annotations

import jinja2

from deploykit.report.plots import error_histogram_png
from deploykit.validation.validate import CandidateValidation

_TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("deploykit.report", "templates"),
    autoescape=jinja2.select_autoescape(["html", "j2"]),
    undefined=jinja2.StrictUndefined,
)


def render_html(report: dict, validations: list[CandidateValidation]) -> str:
    """HTML page of ``report`` with one error histogram per validated candidate."""
    plots = {
        v.label: error_histogram_png(v.runs[-1].outputs, f"{v.label}, batch {v.runs[-1].batch}")
        for v in validations
    }
    return _TEMPLATES.get_template("report.html.j2").render(report=report, plots=plots)
