"""End-to-end harness: a Kubernetes API emulator plus a local controller-manager and kubelet.

See ``e2e/README.md`` for exactly what is emulated and what is not.
"""
