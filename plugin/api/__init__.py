"""Generated gRPC code for the kubelet device plugin API v1beta1 and PodResources API v1 (never edited by hand)."""
