"""Benchmarks and load tools for SITS; each `benchmarks/<name>.py` with a `main` also runs as a script."""
