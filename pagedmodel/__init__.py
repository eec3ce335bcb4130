"""pagedmodel: Kubernetes-native paged-KV LLM serving."""
