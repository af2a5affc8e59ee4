"""DiT service package: MiniMax-H3 model, packed layouts, checkpoints and the streaming runtime."""
