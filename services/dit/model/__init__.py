"""The MiniMax-H3 network and what is applied to it from outside: packed layout, attention kernels, FP8 linears,
the TaoMate LoRA, the AdaLN cache, block CUDA graphs and checkpoint loading. Knows nothing about sessions,
streaming phases or ranks."""
