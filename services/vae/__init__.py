"""VAE service: MiniMax-H3 video/audio decoders (model.py), phase-by-phase decoding (incremental.py), checkpoints."""
