"""A Ulysses DiT group of N ranks on one node: sequence sharding of the model, rank processes, the control records
rank 0 sends and the lock-step worker loop. Wraps `services.dit.stream`; knows nothing about gRPC."""
