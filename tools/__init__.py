"""Benchmarks, profilers, probes and diagnostics of vitascope. Imports `services`; the product never imports this
package, and the images do not ship it."""
