"""End-to-end harness: a real Kubernetes control plane built from the Go modules (e2e/kube/) and our
process kubelet as its node (e2e/kubelet/).

See ``e2e/README.md`` for what is real and what our kubelet does not do.
"""
