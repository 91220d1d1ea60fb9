"""Dynamic MIG: a demand-driven repartitioning planner, its fragmentation measure, and one live round."""
