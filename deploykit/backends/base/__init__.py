"""What every backend shares: the runner contract, feeds and outputs, device memory."""
