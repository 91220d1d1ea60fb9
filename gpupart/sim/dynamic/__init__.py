"""Dynamic MIG in simulation: workloads with arrivals and departures, baseline policies, the event-driven replay."""
