"""The conversion pipeline: load the model, export ONNX, run the passes, write the precision, build engines.

``pipeline`` runs the stages over one conversion state; ``loading`` (model files), ``export``
(torch -> ONNX), ``precision`` (the reduced-precision stage) and ``engine`` (the TensorRT stage) are
the stages that are more than one call.
"""
