"""End-to-end harness: a real Kubernetes control plane built from the Go modules (e2e/kube/) and a real
node, the kubelet on containerd running the chart's image (e2e/node/).

See ``e2e/README.md`` for what runs, what it costs and how to read a pod's logs.
"""
