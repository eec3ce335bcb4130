"""The local controller-manager: scheduler, workload, endpoints, namespace and garbage-collection loops."""
