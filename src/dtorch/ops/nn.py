"""(op family: nn) - being written."""
