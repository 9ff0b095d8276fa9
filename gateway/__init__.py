"""The OpenAI-compatible HTTP gateway and the ``kvpool`` command line."""
