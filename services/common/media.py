"""Media rates and request lengths the model fixes for every stage: 24 video frames per second, 32 kHz audio, and
the 5 s requests a session streams (the DiT's `geometry` builds their clips and phases from these).

Plain constants without torch, so the gateway and the CLI client import them as the stages do.
"""

VIDEO_FPS = 24
AUDIO_SAMPLE_RATE = 32_000
FIRST_REQUEST_FRAMES = 124
"""Pixel frames of a session's first request: a 5-frame prefix and seven 17-frame clips."""
LATER_REQUEST_FRAMES = 119
"""Pixel frames of every later request: seven 17-frame clips."""
PHASES_PER_REQUEST = 4
"""Causal phases (streamed chunks of latents) per request."""
