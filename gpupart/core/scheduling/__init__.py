"""Scheduling decisions: which GPUs of a node can take a pod, why not, how good a fit is, and whom to preempt."""
