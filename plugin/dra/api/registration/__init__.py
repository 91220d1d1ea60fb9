"""Generated gRPC code for the kubelet plugin registration API (pluginregistration/v1)."""
