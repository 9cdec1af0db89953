"""``deploykit serve``: bundles behind the Open Inference Protocol (KServe v2) with dynamic batching.

``protocol`` (the v2 wire format, JSON and binary tensors), ``models`` (bundles loaded by
``deploykit.load``, one runner per instance, requests checked against the manifest),
``placement`` (which device each instance runs on), ``batching`` (the queue and the worker per
runner; ``staging``: where a GPU batch is assembled, in page-locked host buffers or on the GPU from
page-locked request buffers), ``metrics`` (Prometheus), ``app`` (the FastAPI routes, auth, limits,
access log), ``server`` (uvicorn, graceful shutdown), ``workers`` and ``model_host`` (``--workers``: HTTP
processes in front of one model process) and ``launch`` (a server in a subprocess, for the load
benchmark and the tests). FastAPI, uvicorn and prometheus-client come with the
``deploykit[serve]`` extra.
"""
