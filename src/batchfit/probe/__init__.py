"""Running real (or virtual) training steps to find the largest batch that fits."""
