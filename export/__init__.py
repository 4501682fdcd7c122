"""specrt.export: torch model definitions, checkpoint loading and (later) ONNX export."""
