"""`python -m tools.train.cost`: the counts behind the training job's caches and packed forwards."""
import json

import pytest

from tools.train import cost

pytestmark = [pytest.mark.cpu, pytest.mark.slow]


def test_the_cost_figures_show_the_encoder_dominates_and_packing_dispatches_fewer_operations(tmp_path, capsys):
    cost.main(["--json", str(tmp_path / "cost.json")])
    figures = json.loads((tmp_path / "cost.json").read_text())
    assert "video_encode_window_gflop" in capsys.readouterr().out
    assert figures["video_encode_window_gflop"] > 50 * figures["video_decode_window_gflop"]
    assert figures["video_encode_clip_gflop"] > 100 * figures["dit_clip_matmul_gflop"]
    assert figures["base_step_ops_packed"] < 0.6 * figures["base_step_ops_separate"]
    assert figures["student_step_ops"] > 0 and 0 < figures["teacher_layout_ms"] < 100
