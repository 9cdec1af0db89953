"""Tuning: time every backend that can run a bundle here, check its outputs, record the fastest.

``candidates``: what can run here and how to open it; ``timing``: the one timer (shared with
bench); ``checking``: each candidate's outputs against a reference; ``record``: the manifest's
``tuning`` table and the report's section; ``tune``: the run over all of them; ``route``: the
runner ``deploykit.load(backend="auto")`` returns for a tuned bundle. docs/tuning.md.
"""
