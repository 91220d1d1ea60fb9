"""Generated gRPC code for the kubelet DRA resource health API v1alpha1 (never edited by hand)."""
