"""What the next dollar buys: value drafters on nested fractions of each dataset, their curves, the plan."""
