"""The local kubelet: runs each pod's containers as processes on the pod's own loopback address."""
