"""Cluster-side decisions of the operator: which partition gets which GPUs of which node, and its status."""
