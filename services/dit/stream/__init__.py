"""The TaoMate-H3 streaming runtime on one rank: sessions, geometry, timeline, sampling schedule, the clean
audio+video KV cache, the attention pattern over it and the audio teacher. Uses `services.dit.model`; knows
nothing about gRPC or how ranks are coordinated."""
