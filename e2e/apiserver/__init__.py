"""A Kubernetes API server stand-in speaking the real REST + watch protocol on loopback."""
