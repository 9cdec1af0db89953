"""Reading what ``deploykit convert`` recorded in a bundle's report.json."""

from __future__ import annotations


def custom_op_counts(report: dict) -> dict[str, int]:
    """deploykit op -> how many of it the converted graph holds."""
    return {op["name"]: op["after"] for op in report["graph"]["ops"] if op["name"].startswith("deploykit::")}
