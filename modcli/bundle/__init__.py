"""`modcli export`: lowering to ONNX / torch.export, validation against eager, writing the bundle."""
