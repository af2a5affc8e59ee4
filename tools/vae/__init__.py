"""VAE decode and muxer benchmarks."""
