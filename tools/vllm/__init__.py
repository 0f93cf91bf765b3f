"""The vLLM end-to-end run: ``e2e.py`` (the command line) and ``harness/`` (its parts)."""
