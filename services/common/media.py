"""Media rates the model fixes for every stage: 24 video frames per second and 32 kHz audio.

Plain constants without torch, so the gateway and the CLI client import them as the stages do.
"""

VIDEO_FPS = 24
AUDIO_SAMPLE_RATE = 32_000
