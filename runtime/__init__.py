"""SITS runtime: the inference engine and its OpenAI-compatible server."""
