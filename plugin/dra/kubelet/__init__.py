"""The DRA kubelet plugin: registration, Node(Un)PrepareResources, the health stream, checkpoint and CDI specs."""
