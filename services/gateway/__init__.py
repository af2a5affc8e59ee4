"""Realtime websocket gateway: `/v1/realtime/video` (vLLM-Omni compatible), health, metrics and the browser page.

The gateway never imports torch: it talks to the backend through the `pipeline.Pipeline` ABC.
"""
