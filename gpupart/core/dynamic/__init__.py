"""Dynamic MIG: a demand-driven repartitioning planner, its fragmentation measure, and its simulator."""
