"""The HTML pages' one jinja environment (templates in ``report/templates/``) and PNG embedding."""

from __future__ import annotations

import base64

import jinja2

_TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("deploykit.report", "templates"),
    autoescape=jinja2.select_autoescape(["html", "j2"]),
    undefined=jinja2.StrictUndefined,
)


def render(template: str, **context) -> str:
    """``template`` (a file of ``report/templates/``) rendered with ``context``."""
    return _TEMPLATES.get_template(template).render(**context)


def png_base64(png: bytes) -> str:
    """PNG bytes as the text of a ``data:image/png;base64,`` URL, for an image inside the page."""
    return base64.b64encode(png).decode("ascii")
