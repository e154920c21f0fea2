"""onnxruntime session settings: what `create_session` asks for is what `session_settings` (and so the profile
output) records."""

from __future__ import annotations

import onnx
import pytest
from modcli_runtime import bundle as runtime_bundle
from onnx import TensorProto, helper


def _identity_model(path):
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), str(path))


@pytest.mark.parametrize(("spinning", "stop_spinning"), [(True, False), (False, False), (True, True)])
def test_the_session_runs_with_the_recorded_spinning_settings(tmp_path, monkeypatch, spinning, stop_spinning):
    import onnxruntime as ort

    seen = []
    real_session = ort.InferenceSession

    def spy(path, sess_options=None, providers=None):
        seen.append(sess_options)
        return real_session(path, sess_options=sess_options, providers=providers)

    monkeypatch.setattr(ort, "InferenceSession", spy)
    path = tmp_path / "identity.onnx"
    _identity_model(path)
    runtime_bundle.create_session(path, ["CPUExecutionProvider"], threads=1, spinning=spinning,
                                  stop_spinning=stop_spinning)
    options = seen[0]
    recorded = runtime_bundle.session_settings(1, spinning, stop_spinning)
    assert options.intra_op_num_threads == recorded["intra_op_threads"] == 1
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == str(int(recorded["allow_spinning"]))
    assert options.get_session_config_entry("session.force_spinning_stop") == str(int(recorded["force_spinning_stop"]))


def test_profile_records_spinning_within_a_call_and_stopped_after_it():
    import torch

    from modcli.profiling.onnx import onnxruntime_settings

    settings = onnxruntime_settings(torch.device("cpu"))
    assert settings["allow_spinning"] is True and settings["force_spinning_stop"] is True
    assert settings["settle_after_pytorch_s"] > 0  # the pause before an onnxruntime call that follows a PyTorch one
    assert settings["provider"] == "CPUExecutionProvider"
