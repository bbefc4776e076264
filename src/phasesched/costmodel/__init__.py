"""Cost models: how long a step takes."""
