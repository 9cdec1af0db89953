"""The manifest's ``tuning`` table, and the tuning section of report.json and report.html.

The manifest is rewritten atomically (``deploykit.bundle.write.replace_files``); the sha256
entries of the graph, op library, engines and packages stay as they were. The report files change (they gain
the table), so their two entries are refreshed in the same manifest write. ``machine`` and
``mismatch`` say whether a table was taken on the machine that reads it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from deploykit.backends.tensorrt.shim import local_gpus
from deploykit.bundle.format import MANIFEST, REPORT, REPORT_PAGE, sha256_of
from deploykit.bundle.write import replace_files
from deploykit.report.html import render

#: Where report.html holds the tuning section (written empty by convert, filled by tune).
SECTION = re.compile(r"<!-- tuning -->.*<!-- /tuning -->", re.S)


def machine(device: str, device_id: int = 0) -> dict:
    """``device``, ``gpu`` and ``cuda_arch`` of this machine as a tuning table records them."""
    if device != "cuda":
        return {"device": "cpu", "gpu": None, "cuda_arch": None}
    gpus = local_gpus()
    if isinstance(gpus, str) or device_id >= len(gpus):
        return {"device": "cuda", "gpu": None, "cuda_arch": None}
    name, capability = gpus[device_id]
    return {"device": "cuda", "gpu": name, "cuda_arch": capability}


def mismatch(tuning: dict, here: dict) -> str | None:
    """Why a tuning table does not describe this machine (None: it does)."""
    if tuning["device"] != here["device"]:
        return f"it was tuned on {tuning['device']}, this runs on {here['device']}"
    for key, what in (("gpu", "GPU"), ("cuda_arch", "compute capability")):
        if tuning.get(key) != here.get(key):
            return f"it was tuned on {what} {tuning.get(key)}, this is {here.get(key)}"
    return None


def write_tuning(bundle: Path, tuning: dict) -> None:
    """Record ``tuning`` in the bundle: the report's section first, then the manifest that lists it."""
    manifest = json.loads((bundle / MANIFEST).read_text())
    files = manifest.get("files", {})
    for name, text in _reports(bundle, tuning).items():
        replace_files(bundle, {name: text})
        if name in files:
            files[name] = {"sha256": sha256_of(bundle / name), "bytes": (bundle / name).stat().st_size}
    manifest["tuning"] = tuning
    replace_files(bundle, {MANIFEST: json.dumps(manifest, indent=2) + "\n"})


def _reports(bundle: Path, tuning: dict) -> dict[str, str]:
    """report.json with its ``tuning`` key and report.html with its section, for the reports the bundle has."""
    texts = {}
    if (bundle / REPORT).is_file():
        report = json.loads((bundle / REPORT).read_text())
        report["tuning"] = tuning
        texts[REPORT] = json.dumps(report, indent=2) + "\n"
    if (bundle / REPORT_PAGE).is_file():
        page, section = (bundle / REPORT_PAGE).read_text(), html_section(tuning)
        texts[REPORT_PAGE] = (SECTION.sub(lambda _: section, page, count=1) if SECTION.search(page)
                              else page.replace("</body>", section + "\n</body>", 1))
    return texts


def html_section(tuning: dict | None) -> str:
    """The tuning section of report.html, between its markers (empty without a table)."""
    return render("tuning.html.j2", tuning=tuning)
