"""nanoBragg's automatic rules: a SimulationConfig checked and resolved into a static Setup."""
