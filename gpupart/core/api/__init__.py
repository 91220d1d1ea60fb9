"""The API and wire formats: GpuPartition specs, annotations, resource names and quantities, strict records."""
