"""The conversion pipeline: load the model, export ONNX, run the passes, write the precision, build engines.

``pipeline`` runs the steps (its ``STEPS``) over one ``state.ConversionState``, for the
``options.ConvertOptions`` the user gave, and ``report`` builds report.json from that state;
``loading`` (model files), ``export`` (torch -> ONNX), ``precision`` (the reduced-precision stage) and
``engine`` (the TensorRT stage) are the stages that are more than one call.
"""
