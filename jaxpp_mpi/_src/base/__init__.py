"""The bottom layer: options read from the environment, errors, type aliases,
JAX-version differences, bounded reads of untrusted files."""
