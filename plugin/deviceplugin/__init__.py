"""The kubelet device plugin interface: device hub, servers, registration, Allocate, and the Node status."""
