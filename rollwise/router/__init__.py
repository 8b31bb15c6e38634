"""Global cache-aware scheduling of generation requests across rollout replicas. Imports no torch."""
