"""The always-on daemon: sampling, traffic tagging proxy, metrics, crash-safe storage."""
