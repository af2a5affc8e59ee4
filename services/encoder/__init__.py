"""Text encoder service: the Qwen3-VL text stack of MiniMax-H3 (model.py) and its checkpoints (checkpoint.py)."""
